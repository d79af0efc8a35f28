"""The etcd request benchmark's reading of etcd's and kvplane's metrics."""

from __future__ import annotations

from kvplane.bench.etcd_requests_bench import etcd_counters, op_counters

KV = 'grpc_service="etcdserverpb.KV",grpc_type="unary"'
LEASE = 'grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"'
ETCD = f"""\
# HELP grpc_server_handled_total Total number of RPCs completed on the server.
grpc_server_handled_total{{grpc_code="OK",grpc_method="Txn",{KV}}} 7
grpc_server_handled_total{{grpc_code="FailedPrecondition",grpc_method="Txn",{KV}}} 2
grpc_server_handled_total{{grpc_code="OK",grpc_method="Range",{KV}}} 3
grpc_server_handled_total{{grpc_code="OK",grpc_method="LeaseKeepAlive",{LEASE}}} 1
grpc_server_msg_received_total{{grpc_method="LeaseKeepAlive",{LEASE}}} 5
grpc_server_handled_total{{grpc_code="OK",grpc_method="Watch",{LEASE}}} 4
etcd_server_proposals_committed_total 11
etcd_debugging_mvcc_put_total 6
etcd_debugging_mvcc_db_compaction_total_duration_milliseconds_count 0
"""

KVPLANE = """\
kvplane_etcd_request_seconds_count{op="publish",outcome="ok"} 4.0
kvplane_etcd_request_seconds_count{op="publish",outcome="error"} 1.0
kvplane_etcd_request_seconds_bucket{le="0.01",op="publish",outcome="ok"} 4.0
kvplane_etcd_request_seconds_count{op="check_out",outcome="ok"} 2.0
"""


def test_etcd_requests_are_counted_by_method_across_codes_and_keep_alives_by_message() -> None:
    counts = etcd_counters(ETCD)
    assert counts["Txn"] == 9 and counts["Range"] == 3
    assert counts["LeaseKeepAlive"] == 5, "one message per refresh, not one per stream"
    assert "Watch" not in counts
    assert counts["writes (raft proposals)"] == 11 and counts["mvcc put"] == 6


def test_kvplane_requests_are_counted_by_operation_across_outcomes() -> None:
    assert op_counters(KVPLANE) == {"publish": 5.0, "check_out": 2.0}
