"""Gateway and engine in one replica."""
