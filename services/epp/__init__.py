"""kvplane as a Gateway API Inference Extension endpoint picker (`kvplane epp`).

An Envoy-based inference gateway (Istio, kgateway, GKE, Envoy AI Gateway) asks an endpoint picker
over Envoy's `ext_proc` gRPC protocol where each request goes. kvplane's picker answers with the
decisions its own gateway makes: the turn is admitted, routed and reported by the gateway's code,
and sent to the decode engine's sidecar (`kvplane sidecar`), which runs the P and D legs. The
request phase is `exchange.py`'s, the response phase `response_phase.py`'s.

Envoy's side (the dev stack's and the tests' configuration is the worked example,
`devstack/envoy.py`): an `ext_proc` filter with FULL_DUPLEX_STREAMED request and response
bodies, trailers sent, `envoy.lb` among the metadata namespaces it may write, and a cluster of the
decode sidecars balanced by `override_host` on `envoy.lb`'s `x-gateway-destination-endpoint`,
with one retry on another sidecar when a decode engine cannot be reached.

    epp:
      listen: 0.0.0.0:9002
      tenant_source: api_key       # or header (tenant_header, set by the gateway's auth filter)
      sidecar_port: 8000
    sidecar:
      route_key: "<shared with every sidecar>"
    gateway:                       # routing, API keys, limits, cache salts: the gateway's settings
      routing: [kvplane-routing:50051]
      api_keys_file: /etc/kvplane/keys.yaml
"""
