"""The whole stack over HTTP."""
