"""A family that mcore does not ship, written as a contributor would (one models module, one bridge module) and
registered by a pytest plugin, to show that registering a family puts it under every per-family test."""
