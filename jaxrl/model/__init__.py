"""Decoder-only transformer families as pure functions over parameter pytrees."""
