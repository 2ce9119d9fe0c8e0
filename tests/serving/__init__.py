"""Gateway, engine replica, router and CLI units."""
