"""The domain model: nodes, handles, their keys, errors and validation, and their protobuf form.

Pure values and rules: importing nothing of kvplane but each other and the API (`kvplane.v1`), and
the connector's token digests. The bottom layer: the rest of `common`, the services, the client and
the connector build on it.
"""
