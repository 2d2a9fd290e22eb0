"""rltrain.registry.Registry: duplicate names rejected, unknown names listed."""

import pytest

from rltrain.registry import Registry


def test_registry_rules():
    reg = Registry("widget")
    reg.register("b")(1)
    reg.register("a")(2)
    assert reg.get("a") == 2 and "b" in reg and reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(3)
    with pytest.raises(ValueError, match="unknown widget 'c'; known: a, b"):
        reg.get("c")
