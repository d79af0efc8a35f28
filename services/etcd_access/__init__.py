"""Who may reach kvplane's etcd, and how: one etcd user per kvplane process kind, each with read
and write on kvplane's key prefix alone, authenticated by the Common Name of its client
certificate (etcd's `--client-cert-auth`).

`principals.py` names the users and their role; `auth_plan.py` works out, from what etcd holds,
what is missing (pure); `auth_setup.py` reads etcd's Auth API and applies the plan
(`kvplane etcd-setup`); `certificates.py` issues the CA and certificates a deployment needs
(`kvplane dev-certs`); `cli.py` holds both commands.
"""
