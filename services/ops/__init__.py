"""Operations commands: `kvplane nodes`, `handles`, `drain`, `status`, `end-conversation`.

Each is a thin client of an existing RPC, called with the operator's credentials
(`KVPLANE_CLIENT_*`, or the flags), printing a readable table or, with `--json`, JSON.
`views.py` turns the replies into rows (pure); `cli.py` parses, calls and prints.
"""
