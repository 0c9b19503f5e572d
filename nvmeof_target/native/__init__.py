"""The native front: listener, one session per connection, and the request handlers."""
