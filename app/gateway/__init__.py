"""The OpenAI-compatible ingress: tenants, adapter resolution and authorisation, admission, the admin API."""
