"""The plug-in registry every kind of part shares: built-ins, registered parts, entry points, dotted paths."""

import pytest

from longhorizon.common.plugins import PluginError, Registry, load_dotted


def number_registry(check=None) -> Registry:
    return Registry("widget", "longhorizon.test_widgets", {"json": "json:dumps"}, check=check)


def test_builtins_load_lazily_and_by_the_same_lookup():
    import json

    registry = number_registry()
    assert registry.names() == ["json"]
    assert registry.get("json") is json.dumps


def test_an_installed_package_adds_a_part_through_its_entry_point(install_plugin):
    install_plugin("outside_widgets", "def make():\n    return 42\n",
                   {"longhorizon.test_widgets": {"answer": "outside_widgets:make"}})
    registry = number_registry()
    assert registry.names() == ["answer", "json"]
    assert registry.get("answer")() == 42


def test_a_dotted_path_loads_code_that_is_not_installed(install_plugin):
    install_plugin("loose_widgets", "class Widget:\n    size = 3\n")
    assert number_registry().get("loose_widgets:Widget").size == 3
    with pytest.raises(PluginError, match="has no attribute 'Gadget'"):
        number_registry().get("loose_widgets:Gadget")
    with pytest.raises(PluginError, match="cannot import 'no_such_package.module'"):
        load_dotted("no_such_package.module:thing")


def test_unknown_names_list_what_exists():
    with pytest.raises(PluginError, match=r"unknown widget 'jsn'; available: json"):
        number_registry().get("jsn")


def test_an_entry_point_may_not_take_a_builtin_name(install_plugin):
    install_plugin("shadowing", "def dumps(x):\n    return ''\n",
                   {"longhorizon.test_widgets": {"json": "shadowing:dumps"}})
    with pytest.raises(PluginError, match="reuses the name of the built-in widget"):
        number_registry().get("other")


def test_a_plugin_that_fails_to_import_is_named(install_plugin):
    install_plugin("broken_widgets", "raise RuntimeError('missing dependency xyz')\n",
                   {"longhorizon.test_widgets": {"broken": "broken_widgets:make"}})
    with pytest.raises(PluginError, match=r"widget 'broken' \(broken_widgets:make\) failed to load: missing dependency xyz"):
        number_registry().get("broken")


def test_register_refuses_clashes_and_the_check_refuses_wrong_objects():
    def must_be_callable(name, part):
        if not callable(part):
            raise TypeError(f"widget {name!r} is not callable")

    registry = number_registry(check=must_be_callable)
    registry.register("double", lambda x: 2 * x)
    assert registry.get("double")(4) == 8
    with pytest.raises(ValueError, match="already registered"):
        registry.register("double", lambda x: x)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("json", lambda x: x)
    with pytest.raises(TypeError, match="not callable"):
        registry.register("seven", 7)
    registry.unregister("double")
    assert "double" not in registry.names()
