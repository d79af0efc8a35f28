"""Development tooling that is not part of a deployed process: a local etcd for tests, benches and
the dev stack."""
