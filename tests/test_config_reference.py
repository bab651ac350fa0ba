"""docs/config.md is the key reference written from the config's schema, and stays so."""

from pathlib import Path

from longhorizon.common.config import Config
from longhorizon.launch.config_reference import config_reference, current_reference

DOCS = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_the_key_reference_in_the_docs_is_the_one_the_schema_writes():
    assert DOCS.read_text() == current_reference(), (
        "docs/config.md differs from the config's declarations: run `longhorizon config reference > docs/config.md`")


def test_every_table_and_key_has_a_row():
    text = current_reference()
    for table, field in Config.model_fields.items():
        assert f"## [{table}]" in text, table
        for key in field.annotation.model_fields:
            assert f"| `{key}` |" in text or f"## [{table}.{key}]" in text, f"{table}.{key}"


def test_a_row_says_type_default_range_and_meaning():
    schema = {
        "properties": {"run": {"$ref": "#/$defs/Run"}},
        "$defs": {
            "Run": {"properties": {
                "steps": {"type": "integer", "default": 10, "minimum": 1, "description": "How many.\nSteps | total."},
                "rate": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None, "exclusiveMinimum": 0,
                         "maximum": 1, "description": "A share."},
                "sub": {"$ref": "#/$defs/Sub", "description": "Nested keys."},
                "how": {"enum": ["a", "b"], "type": "string", "default": "a", "description": "Which."},
                "when": {"anyOf": [{"type": "boolean"}, {"const": "auto", "type": "string"}], "default": "auto"},
            }},
            "Sub": {"properties": {"names": {"type": "array", "items": {"type": "string"}, "description": "Names."}}},
        },
    }
    text = config_reference(schema, {"mine": {"description": "Its keys.", "properties": {}}})
    assert "| `steps` | int | `10` | >= 1 | How many. Steps \\| total. |" in text
    assert "| `rate` | float or unset | unset | > 0, <= 1 | A share. |" in text
    assert "## [run.sub]\n\nNested keys.\n" in text and "| `names` | list of str | (required) |  | Names. |" in text
    assert "### mine\n\nIts keys.\n\nNo keys." in text
    assert '| `how` | one of `"a"`, `"b"` | `"a"` |  | Which. |' in text
    assert '| `when` | bool or `"auto"` | `"auto"` |  |  |' in text
