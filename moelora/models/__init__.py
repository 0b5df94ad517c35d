"""Model families (registry by architecture name), weight loading, dummy weights."""
