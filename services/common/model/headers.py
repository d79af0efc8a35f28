"""The call metadata keys of kvplane's gRPC API that the protos cannot name.

Clients send them (`kvplane.services.client.credentials`) and the servers' authentication reads
them (`auth.py`, where each is explained); a mesh proxy adds the identity ones. Constants only:
the client imports this without the servers' runtime.
"""

from __future__ import annotations

# The mesh proxy's shared secret, proving that the identity headers below come from it.
MESH_SECRET_HEADER = "x-kvplane-mesh-secret"
# The caller a mesh proxy names: its role (tenant, node or operator), then the name for that role.
ROLE_HEADER = "x-kvplane-role"
TENANT_HEADER = "x-kvplane-tenant"
NODE_HEADER = "x-kvplane-node"
OPERATOR_HEADER = "x-kvplane-operator"
