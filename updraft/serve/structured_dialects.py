"""Structured outputs' dialects, read in one place into the one spec the engine takes
(``StructuredOutputsParams``). Three shapes come, on both routes: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object, and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields. A request names at most one of them. A ``json_schema`` with
``"strict": true`` keeps OpenAI's strict-mode rules (serve/strict_schemas.py). (A chat request's
required tool call is a spec too: serve/parsers/tools.py.)
"""

from __future__ import annotations

from typing import Any

from updraft.serve.errors import APIError
from updraft.serve.strict_schemas import strict_schema_error
from updraft.structured_outputs import StructuredOutputsParams

# vLLM's older fields, and the StructuredOutputsParams field each one is.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs keys that choose among its backends: nothing to choose here.
IGNORED_STRUCTURED_KEYS = {"disable_fallback"}
# Every request field that can ask for structured outputs.
DIALECT_FIELDS = (*GUIDED_FIELDS, "structured_outputs", "response_format")


def structured_outputs_field(fields: dict[str, Any]) -> str | None:
    """Of a request's ``DIALECT_FIELDS`` (name -> value), the one that asks for
    structured outputs, if any; two are a 400."""
    given = [name for name in GUIDED_FIELDS if fields[name] is not None]
    if fields["structured_outputs"] is not None:
        given.append("structured_outputs")
    response_format = fields["response_format"]
    if response_format is not None and response_format.get("type") != "text":
        given.append("response_format")
    if len(given) > 1:
        raise APIError(
            400,
            f"{given[1]}: only one way of asking for structured outputs per request, "
            f"got {', '.join(given)}",
            param=given[1],
        )
    return given[0] if given else None


def structured_outputs_params(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The spec a request's ``DIALECT_FIELDS`` ask for in whichever dialect, or None."""
    field = structured_outputs_field(fields)
    if field is None:
        if fields["response_format"] is not None:
            _response_format(fields["response_format"])  # a text one, checked all the same
        return None
    if field == "response_format":
        values = _response_format(fields["response_format"])
    elif field == "structured_outputs":
        values = _structured_outputs(fields["structured_outputs"])
    else:
        values = {GUIDED_FIELDS[field]: fields[field]}
    try:
        return StructuredOutputsParams(**values)
    except ValueError as error:
        message = str(error).removeprefix("structured_outputs")
        raise APIError(400, f"{field}{message}", param=field) from error


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema: a JSON schema object is required",
                param="response_format",
            )
        if spec.get("strict") is True:
            problem = strict_schema_error(schema)
            if problem is not None:
                raise APIError(
                    400, f"response_format.json_schema.schema: {problem}", param="response_format"
                )
        return {"json": schema}
    raise APIError(
        400,
        f"response_format.type: must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs object as StructuredOutputsParams fields."""
    known = {"json", "json_object", "regex", "choice", "grammar"}
    unknown = sorted(set(value) - known - IGNORED_STRUCTURED_KEYS)
    if unknown:
        raise APIError(
            400,
            f"structured_outputs.{unknown[0]}: not supported (supported: "
            f"{', '.join(sorted(known))})",
            param="structured_outputs",
        )
    return {k: v for k, v in value.items() if k in known and v not in (None, False)}
