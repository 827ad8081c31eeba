"""The OpenAPI 3.1 document of the box's HTTP API, served without auth at ``GET /openapi.json``.

The request bodies of chat completions, completions and embeddings are described field by field
in ``CHAT``, ``COMPLETION`` and ``EMBEDDING`` (JSON type, bounds, allowed values, required).
Their numeric bounds and caps are read from ``web.validation`` itself (``SAMPLING``, ``MAX_*``,
``ROLES``), and tests/unit/test_openapi.py checks every described field against the validator
(a wrong type, a value past a bound or outside the allowed ones is refused naming the field), so
the document and the validator cannot drift apart unnoticed. The Responses and Messages bodies
list the fields their translators accept (``FIELDS``, ``MESSAGE_FIELDS``, ``COUNT_FIELDS``):
those refuse any other field. The settings schema comes from ``residency.settings.key_meta``.
"""

from __future__ import annotations

from functools import cache
from typing import Any, get_args

from flask import Blueprint, Response, jsonify

from residency import keys
from residency.settings import ModelType, key_meta
from web import anthropic, rerank, responses_request
from web import validation as v

bp = Blueprint("openapi", __name__)

Schema = dict[str, Any]

VERSION = "0.1.0"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


# --- request fields ---------------------------------------------------------------------------

_STR: Schema = {"type": "string"}
_MODEL: Schema = {"type": "string", "minLength": 1, "description": "a model or policy name"}
_STREAM: Schema = {"type": "boolean"}
_STREAM_OPTIONS: Schema = {
    "type": "object",
    "properties": {"include_usage": {"type": "boolean"}},
    "description": "only with stream: true",
}
_STOP_STRING: Schema = {"type": "string", "maxLength": v.MAX_STOP_CHARS}
_ROUTE_TRACE: Schema = {
    "type": "boolean",
    "description": "add the routing decision to the answer (needs the route_trace scope)",
}


def _sampling() -> dict[str, Schema]:
    out: dict[str, Schema] = {}
    for name, (lo, hi, integer) in v.SAMPLING.items():
        out[name] = {
            "type": "integer" if integer else "number",
            "minimum": int(lo) if integer else lo,
            "maximum": int(hi) if integer else hi,
        }
    for name in ("max_tokens", "max_completion_tokens"):
        out[name] = {"type": "integer", "minimum": 1, "maximum": v.MAX_INT32}
    out["stop"] = {
        "oneOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": v.MAX_STOP}]
    }
    out["seed"] = {"type": "integer", "minimum": v.INT64[0], "maximum": v.INT64[1]}
    out["logit_bias"] = {
        "type": "object",
        "maxProperties": v.MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id -> bias",
    }
    out["n"] = {"type": "integer", "enum": [1], "description": "one choice per request"}
    return out


_TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART: Schema = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {
                "url": {
                    "type": "string",
                    "description": "a base64 data: URL of a PNG, JPEG, GIF or BMP image, "
                    "or an http(s) URL (fetched by the box for a local model)",
                }
            },
        },
    },
}
_CHAT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": sorted(v.ROLES)},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": v.MAX_CONTENT_PARTS,
                    "items": {"oneOf": [_TEXT_PART, _IMAGE_PART]},
                },
            ]
        },
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
        "reasoning_content": {
            "type": "string",
            "description": "assistant messages only: the model's reasoning in that turn",
        },
    },
}
_FUNCTION_TOOL: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON schema"},
            },
        },
    },
}
_NAMED_CHOICE: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
        },
    },
}

#: Chat completions: field -> schema; ``required`` lists the fields a request must have.
CHAT: dict[str, Schema] = {
    "model": _MODEL,
    "messages": {
        "type": "array",
        "minItems": 1,
        "maxItems": v.MAX_MESSAGES,
        "items": _CHAT_MESSAGE,
    },
    **_sampling(),
    "tools": {"type": "array", "maxItems": v.MAX_TOOLS, "items": _FUNCTION_TOOL},
    "tool_choice": {
        "oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, _NAMED_CHOICE]
    },
    "response_format": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "schema": {"type": "object"},
            "json_schema": {
                "type": "object",
                "required": ["schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}},
            },
        },
    },
    "logprobs": {"type": "boolean"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "reasoning_effort": {
        "type": "string",
        "enum": list(v.REASONING_EFFORTS),
        "description": "how much a reasoning model may think (none: not at all)",
    },
    "stream": _STREAM,
    "stream_options": _STREAM_OPTIONS,
    "route_trace": _ROUTE_TRACE,
}
CHAT_REQUIRED = ("model", "messages")

COMPLETION: dict[str, Schema] = {
    "model": _MODEL,
    "prompt": {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        ],
        "description": "one prompt (batches and token arrays are not supported)",
    },
    **_sampling(),
    "best_of": {"type": "integer", "enum": [1]},
    "suffix": {"type": "string"},
    "echo": {"type": "boolean"},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    "stream": _STREAM,
    "stream_options": _STREAM_OPTIONS,
    "route_trace": _ROUTE_TRACE,
}
COMPLETION_REQUIRED = ("model", "prompt")

_EMBED_TEXT: Schema = {"type": "string", "minLength": 1}
EMBEDDING: dict[str, Schema] = {
    "model": _MODEL,
    "input": {
        "oneOf": [
            _EMBED_TEXT,
            {
                "type": "array",
                "items": _EMBED_TEXT,
                "minItems": 1,
                "maxItems": v.MAX_EMBEDDING_INPUTS,
            },
        ],
        "description": "strings only (token arrays are not supported)",
    },
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
}
EMBEDDING_REQUIRED = ("model", "input")

RERANK: dict[str, Schema] = {
    "model": _MODEL,
    "query": {"type": "string", "minLength": 1, "pattern": "\\S"},
    "documents": {
        "type": "array",
        "minItems": 1,
        "maxItems": rerank.MAX_RERANK_DOCUMENTS,
        "items": {
            "oneOf": [
                {"type": "string"},
                {"type": "object", "required": ["text"], "properties": {"text": _STR}},
            ]
        },
    },
    "top_n": {"type": "integer", "minimum": 1},
    "return_documents": {"type": "boolean"},
}
RERANK_REQUIRED = ("model", "query", "documents")

#: Fields the web layer handles before the validator (``openai_api._route_trace_wanted``).
WEB_FIELDS = frozenset({"route_trace"})


def _body(fields: dict[str, Schema], required: tuple[str, ...], *, closed: bool) -> Schema:
    out: Schema = {"type": "object", "required": list(required), "properties": fields}
    # The OpenAI paths accept and ignore fields they have no use for (clients send some on
    # every call); the Responses and Messages translators refuse unknown fields.
    out["additionalProperties"] = not closed
    return out


def _translated(
    fields: frozenset[str], known: dict[str, Schema], required: tuple[str, ...]
) -> Schema:
    """A body whose fields are checked by a translator: the names are exact, the schemas are
    what is known of them (the rest is checked by the translator and then by the chat
    validator)."""
    props = {f: known.get(f, {}) for f in sorted(fields)}
    return _body(props, required, closed=True)


def _responses_body() -> Schema:
    known: dict[str, Schema] = {
        "model": _MODEL,
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1}]},
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": v.MAX_INT32},
        "temperature": CHAT["temperature"],
        "top_p": CHAT["top_p"],
        "stream": _STREAM,
        "tools": {"type": "array"},
        "metadata": {"type": "object"},
        "reasoning": {
            "type": "object",
            "properties": {
                "effort": {"type": "string", "enum": list(responses_request.EFFORTS)},
                "summary": {"description": "accepted and ignored: reasoning is shown whole"},
            },
        },
        "previous_response_id": {"description": "refused: this server stores no responses"},
        "conversation": {"description": "refused: this server stores no responses"},
    }
    return _translated(responses_request.FIELDS, known, ("model", "input"))


_A_TEXT: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_A_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]},
        "content": {
            "oneOf": [
                _STR,
                {
                    "type": "array",
                    "items": {"type": "object", "required": ["type"]},
                    "maxItems": v.MAX_CONTENT_PARTS,
                    "description": "text, image and tool_result (user), tool_use and thinking "
                    "(assistant) blocks",
                },
            ]
        },
    },
}


def _messages_body(count: bool) -> Schema:
    known: dict[str, Schema] = {
        "model": _MODEL,
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": v.MAX_MESSAGES,
            "items": _A_MESSAGE,
        },
        "max_tokens": CHAT["max_tokens"],
        "system": {"oneOf": [_STR, _list(_A_TEXT)]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": CHAT["top_p"],
        "top_k": CHAT["top_k"],
        "stop_sequences": {"type": "array", "items": _STOP_STRING, "maxItems": v.MAX_STOP},
        "stream": _STREAM,
        "metadata": {"type": "object"},
        "tools": {"type": "array"},
        "tool_choice": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": list(anthropic._TOOL_CHOICES)},
                "name": _STR,
            },
        },
        "thinking": {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": list(anthropic.THINKING_TYPES)},
                "budget_tokens": {"type": "integer", "minimum": anthropic.MIN_THINKING_BUDGET},
            },
            "description": "enabled: reasoning_effort low below 4096 budget tokens, medium "
            "below 16384, else high; disabled: none; adaptive: the model's own",
        },
    }
    if count:
        return _translated(anthropic.COUNT_FIELDS, known, ("model", "messages"))
    return _translated(anthropic.MESSAGE_FIELDS, known, ("model", "max_tokens", "messages"))


# --- responses --------------------------------------------------------------------------------

_ERROR: Schema = {
    "type": "object",
    "description": "the OpenAI error envelope (every error but those of /v1/messages*)",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the field at fault"},
                "code": {"type": ["string", "null"]},
            },
        },
        "problems": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "every bad key (settings, users, keys)",
        },
    },
}
_ANTHROPIC_ERROR: Schema = {
    "type": "object",
    "description": "Anthropic's error envelope (/v1/messages and /v1/messages/count_tokens)",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _obj(*required: str, **props: Schema) -> Schema:
    return {"type": "object", "required": list(required), "properties": props}


_INT: Schema = {"type": "integer"}
_OBJ: Schema = {"type": "object"}


def _list(item: Schema) -> Schema:
    return {"type": "array", "items": item}


_MODEL_OBJECT = _obj(
    "id",
    "object",
    "owned_by",
    "type",
    id=_STR,
    object={"const": "model"},
    created=_INT,
    owned_by=_STR,
    type={"type": "string", "enum": [*get_args(ModelType), "policy"]},
    state=_STR,
    pinned={"type": "boolean"},
    candidates=_list(_STR),
    default={"type": ["string", "null"]},
)

SCHEMAS: dict[str, Schema] = {
    "Error": _ERROR,
    "AnthropicError": _ANTHROPIC_ERROR,
    "ChatCompletionRequest": _body(CHAT, CHAT_REQUIRED, closed=False),
    "CompletionRequest": _body(COMPLETION, COMPLETION_REQUIRED, closed=False),
    "EmbeddingRequest": _body(EMBEDDING, EMBEDDING_REQUIRED, closed=False),
    "RerankRequest": _body(RERANK, RERANK_REQUIRED, closed=False),
    "ChatCompletion": _obj(
        "id", "object", "created", "model", "choices", choices=_list(_OBJ), usage=_OBJ
    ),
    "Completion": _obj(
        "id", "object", "created", "model", "choices", choices=_list(_OBJ), usage=_OBJ
    ),
    "EmbeddingList": _obj(
        "object",
        "data",
        object={"const": "list"},
        data=_list(
            _obj(
                "embedding",
                "index",
                index=_INT,
                embedding={"oneOf": [_list({"type": "number"}), _STR]},
            )
        ),
        model=_STR,
        usage=_OBJ,
    ),
    "RerankList": _obj(
        "object",
        "model",
        "results",
        object={"const": "list"},
        model=_STR,
        results=_list(
            _obj(
                "index",
                "relevance_score",
                index=_INT,
                relevance_score={"type": "number"},
                document=_obj("text", text=_STR),
            )
        ),
        usage=_OBJ,
    ),
    "Model": _MODEL_OBJECT,
    "ModelList": _obj("object", "data", object={"const": "list"}, data=_list(_ref("Model"))),
    "Response": _obj("id", "object", "output", id=_STR, object={"const": "response"}),
    "Message": _obj(
        "id", "type", "role", "content", type={"const": "message"}, content=_list(_OBJ)
    ),
    "TokenCount": _obj("input_tokens", input_tokens=_INT),
    # One server-sent event: ``data`` is a JSON chunk (OpenAI: a chat or completion chunk, the
    # last one ``[DONE]``), ``event`` its type on the Responses and Messages streams.
    "Event": _obj("data", data=_STR, event=_STR),
}


def _settings_schema() -> Schema:
    """``GET /admin/ui/settings.json``: every plain key, named as the keys are today."""
    entry = _obj(
        "default",
        "applies",
        "doc",
        default={},
        applies={"type": "string", "enum": sorted({m["applies"] for m in key_meta().values()})},
        doc=_STR,
    )
    return _obj(
        "keys",
        keys={
            "type": "object",
            "properties": {k: entry for k in key_meta()},
            "additionalProperties": False,
        },
    )


# --- operations -------------------------------------------------------------------------------

_API_SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}, {}]
_ADMIN_SECURITY: list[dict[str, list[str]]] = [{"bearer": []}]
_API_ERRORS = (400, 401, 403, 404, 409, 413, 415, 421, 429, 500, 503, 504)
_ADMIN_ERRORS = (400, 401, 403, 404, 409, 413, 415, 421, 503)

_DESCRIPTIONS = {
    400: "invalid request (``param`` names the field)",
    401: "missing or unknown key",
    403: "the key may not do this, or the request's Origin is not allowed (server.cors_origins)",
    404: "unknown model, policy, user, key or token",
    409: "conflict",
    413: "body too large",
    415: "a body that is not application/json",
    421: "a Host this box does not answer to (server.allowed_hosts)",
    429: "over a limit or quota (Retry-After)",
    500: "internal error",
    503: "not ready or Redis unavailable (Retry-After)",
    504: "deadline exceeded",
    501: "not served by this box",
}


def _json(schema: Schema, description: str = "OK") -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(codes: tuple[int, ...], error: str = "Error") -> dict[str, Schema]:
    return {str(c): _json(_ref(error), _DESCRIPTIONS[c]) for c in codes}


def _op(
    summary: str,
    ok: dict[str, Schema],
    *,
    tag: str,
    body: Schema | None = None,
    errors: tuple[int, ...] = (),
    error: str = "Error",
    security: list[dict[str, list[str]]] | None = None,
    params: list[Schema] | None = None,
) -> Schema:
    op: Schema = {"summary": summary, "tags": [tag], "responses": {**ok, **_errors(errors, error)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    op["security"] = security if security is not None else []
    return op


def _generation(summary: str, request: str, answer: str, error: str = "Error") -> Schema:
    ok = {
        "200": {
            "description": "the whole answer, or a stream of server-sent events (stream: true)",
            "content": {
                "application/json": {"schema": _ref(answer)},
                "text/event-stream": {"schema": _ref("Event")},
            },
        }
    }
    return {
        "post": _op(
            summary,
            ok,
            tag="inference",
            body=_ref(request),
            errors=_API_ERRORS,
            error=error,
            security=_API_SECURITY,
        )
    }


def _path_param(name: str, schema: Schema | None = None) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": schema or _STR}


def _query(name: str, description: str, schema: Schema | None = None) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema or _STR,
            "description": description}  # fmt: skip


def _admin(
    summary: str,
    *,
    status: int = 200,
    answer: Schema | None = None,
    body: Schema | None = None,
    params: list[Schema] | None = None,
) -> Schema:
    ok = {str(status): _json(answer or _OBJ)}
    return _op(
        summary,
        ok,
        tag="admin",
        body=body,
        errors=_ADMIN_ERRORS,
        security=_ADMIN_SECURITY,
        params=params,
    )


_NAME = [_path_param("name")]
_PULL = _obj(
    "id",
    "state",
    id=_STR,
    source=_STR,
    host=_STR,
    name=_STR,
    file=_STR,
    state={
        "type": "string",
        "enum": ["queued", "downloading", "verifying", "done", "failed", "cancelled"],
    },
    bytes_done=_INT,
    bytes_total={"type": ["integer", "null"]},
    error={"type": ["string", "null"]},
)
_WRITTEN = _obj("generation", generation=_INT)


def _created(op: Schema) -> Schema:
    """A PUT answers 200 when it replaced, 201 when it created."""
    op["responses"]["201"] = _json(_OBJ, "created")
    return op


def _admin_paths() -> dict[str, Schema]:
    return {
        "/admin/config": {
            "get": _admin(
                "Live settings, where each value comes from, and the generation",
                answer=_obj("config", "sources", "generation", "config_error"),
            ),
            "patch": _admin(
                "Change live settings ({'section.key': value} or nested sections)",
                answer=_obj("updated", "generation", generation=_INT),
                body=_OBJ,
            ),
        },
        "/admin/models": {"get": _admin("Registered models with their residency")},
        "/admin/models/{name}": {
            "get": _admin("One model", params=_NAME),
            "put": _created(_admin("Register or replace a model", body=_OBJ, params=_NAME)),
            "delete": _admin("Remove a model (not one from the config file)", params=_NAME),
        },
        **{
            f"/admin/models/{{name}}/{what}": {
                "post": _admin(
                    f"Ask the coordinator to {what} the model",
                    status=202,
                    answer=_obj("model", "requested"),
                    params=_NAME,
                )
            }
            for what in ("load", "unload")
        },
        "/admin/models/{name}/fit": {
            "post": _admin(
                "Would the model fit now, on which device, and what would be evicted for it "
                "(a dry run: nothing is done)",
                answer=_obj("model", "fits", "resident", "evict", "reason", "need_bytes"),
                params=_NAME,
            )
        },
        "/admin/models/{name}/pin": {
            "post": _admin(
                "Pin or unpin a model",
                body=_obj("pinned", pinned={"type": "boolean"}),
                answer=_WRITTEN,
                params=_NAME,
            )
        },
        "/admin/policies": {"get": _admin("Routing policies")},
        "/admin/policies/validate": {
            "post": _admin(
                "The routing decision for a sample request, without serving it",
                body=_obj(
                    "policy",
                    "request",
                    policy={"oneOf": [_STR, _OBJ]},
                    request=_OBJ,
                ),
                answer=_obj("policy", "candidate", "rule", "used_default", "listed", "trace"),
            )
        },
        "/admin/policies/{name}": {
            "get": _admin("One policy", params=_NAME),
            "put": _created(_admin("Create or replace a policy", body=_OBJ, params=_NAME)),
            "delete": _admin("Remove a policy (not one from the config file)", params=_NAME),
        },
        "/admin/audit": {
            "get": _admin(
                "The newest audit records",
                answer=_obj("audit", audit=_list(_OBJ)),
                params=[
                    _query(
                        "limit",
                        "how many",
                        {"type": "integer", "minimum": 1, "maximum": keys.AUDIT_MAX},
                    )
                ],
            )
        },
        "/admin/cache": {
            "delete": _admin(
                "Empty the saved slot caches (of one model with ?model=): none saved before is "
                "restored from now on; each host deletes the files at its next heartbeat",
                answer=_obj("cleared", "generation", generation=_INT),
                params=[_query("model", "one model (default: every model)")],
            )
        },
        "/admin/faults": {
            "get": _admin("Injected faults (only with debug.fault_injection; 404 otherwise)"),
            "post": _admin("Set or clear injected faults", body=_OBJ),
        },
        "/admin/usage": {
            "get": _admin(
                "Usage per user, model and UTC day",
                params=[
                    _query("from", "first day, YYYY-MM-DD (default today)"),
                    _query("to", "last day, YYYY-MM-DD (default today)"),
                    _query("user", "one user ('-': anonymous callers)"),
                    _query("model", "one model"),
                ],
            )
        },
        "/admin/pulls": {
            "get": _admin("Model pulls, newest first", answer=_obj("pulls", pulls=_list(_PULL))),
            "post": _admin(
                "Pull a model file onto a host and register it (hf:ORG/REPO[:QUANT or FILE] or "
                "an http(s) URL of a .gguf); 429 when the host's pull queue is full",
                status=202,
                body=_obj(
                    "source",
                    source=_STR,
                    name=_STR,
                    host=_STR,
                    dir=_STR,
                    mmproj={"type": "boolean"},
                ),
                answer=_PULL,
            ),
        },
        "/admin/pulls/{pull_id}": {
            "get": _admin("One pull", params=[_path_param("pull_id")], answer=_PULL),
            "delete": _admin(
                "Cancel a pull (its partial file is removed)",
                status=202,
                params=[_path_param("pull_id")],
                answer=_PULL,
            ),
        },
        "/admin/users": {
            "get": _admin("Users", answer=_obj("users", users=_list(_OBJ))),
            "post": _admin("Add a user", status=201, body=_OBJ, answer=_obj("user")),
        },
        "/admin/users/{name}": {
            "get": _admin("One user with their keys", params=_NAME),
            "patch": _admin("Change a user", body=_OBJ, params=_NAME, answer=_obj("user")),
            "delete": _admin("Remove a user and revoke their keys", params=_NAME),
        },
        "/admin/users/{name}/keys": {
            "post": _admin(
                "Issue an API key (the key is in this answer only)",
                status=201,
                body=_OBJ,
                params=_NAME,
                answer=_obj("key", "api_key", key=_STR),
            )
        },
        "/admin/keys": {
            "get": _admin(
                "API keys (never their secrets)",
                answer=_obj("keys", keys=_list(_OBJ)),
                params=[_query("user", "one user's keys")],
            )
        },
        "/admin/keys/{key_id}": {
            "get": _admin("One API key", params=[_path_param("key_id")]),
            "delete": _admin("Revoke an API key", params=[_path_param("key_id")]),
        },
        "/admin/tokens": {
            "get": _admin("Admin tokens", answer=_obj("tokens", tokens=_list(_OBJ))),
            "post": _admin(
                "Add a named admin token (the token is in this answer only)",
                status=201,
                body=_obj("name", name=_STR),
                answer=_obj("token", "name", token=_STR),
            ),
        },
        "/admin/tokens/{name}": {"delete": _admin("Remove an admin token", params=_NAME)},
    }


def _ops_paths() -> dict[str, Schema]:
    status = _obj("status", status=_STR)
    unavailable = _json(
        _obj("status", status=_STR, reasons=_list(_STR), config_error={}),
        "not ready (Retry-After)",
    )
    text = {"text/plain": {"schema": _STR}}
    ops_error = _errors((401, 503))
    return {
        "/livez": {"get": _op("The web process is up", {"200": _json(status)}, tag="ops")},
        "/readyz": {
            "get": _op(
                "Ready for traffic: Redis, a coordinator leader and a live worker agent",
                {"200": _json(status), "503": unavailable},
                tag="ops",
            )
        },
        "/health": {
            "get": _op(
                "The health record the coordinator publishes",
                {"200": _json(_OBJ), "503": unavailable, "401": ops_error["401"]},
                tag="ops",
                security=_API_SECURITY,
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus metrics",
                {"200": {"description": "OK", "content": text}, **ops_error},
                tag="ops",
                security=_API_SECURITY,
            )
        },
        "/openapi.json": {"get": _op("This document", {"200": _json(_OBJ)}, tag="ops")},
        "/admin/ui": {
            "get": _op(
                "The admin dashboard (the page asks for the admin key)",
                {"200": {"description": "OK", "content": {"text/html": {"schema": _STR}}}},
                tag="ui",
            )
        },
        "/admin/ui/settings.json": {
            "get": _op(
                "Every plain settings key: default, whether it applies live, help",
                {"200": _json(_ref("SettingsSchema"))},
                tag="ui",
            )
        },
    }


def _api_paths() -> dict[str, Schema]:
    model_id = [_path_param("model_id")]
    return {
        "/v1/chat/completions": _generation(
            "Chat completion (OpenAI)", "ChatCompletionRequest", "ChatCompletion"
        ),
        "/v1/completions": _generation(
            "Text completion (OpenAI)", "CompletionRequest", "Completion"
        ),
        "/v1/embeddings": {
            "post": _op(
                "Embeddings (OpenAI)",
                {"200": _json(_ref("EmbeddingList"))},
                tag="inference",
                body=_ref("EmbeddingRequest"),
                errors=_API_ERRORS,
                security=_API_SECURITY,
            )
        },
        "/v1/rerank": {
            "post": _op(
                "Documents ranked by relevance to a query (Cohere/Jina shape)",
                {"200": _json(_ref("RerankList"))},
                tag="inference",
                body=_ref("RerankRequest"),
                errors=_API_ERRORS,
                security=_API_SECURITY,
            )
        },
        "/v1/models": {
            "get": _op(
                "Models and policies this key may use",
                {"200": _json(_ref("ModelList"))},
                tag="inference",
                errors=(401, 503),
                security=_API_SECURITY,
            )
        },
        "/v1/models/{model_id}": {
            "get": _op(
                "One model or policy",
                {"200": _json(_ref("Model"))},
                tag="inference",
                errors=(401, 403, 404, 503),
                security=_API_SECURITY,
                params=model_id,
            )
        },
        "/v1/responses": _generation(
            "Response (OpenAI Responses API, stateless)", "ResponseRequest", "Response"
        ),
        "/v1/messages": _generation(
            "Message (Anthropic Messages API)", "MessageRequest", "Message", "AnthropicError"
        ),
        "/v1/messages/count_tokens": {
            "post": _op(
                "Tokens of a Messages request's prompt (Anthropic)",
                {"200": _json(_ref("TokenCount"))},
                tag="inference",
                body=_ref("CountTokensRequest"),
                errors=_API_ERRORS,
                error="AnthropicError",
                security=_API_SECURITY,
            )
        },
    }


_OLLAMA_ERROR: Schema = {
    "type": "object",
    "description": "Ollama's error object (/api/*; in a stream, its last line)",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


def _ollama_paths() -> dict[str, Schema]:
    """Ollama's API (web.ollama_api): its bodies are checked by the translator (web.ollama)
    and then by the chat validator; unknown fields are accepted and named as ignored."""

    def body(*fields: str, required: tuple[str, ...] = ("model",)) -> Schema:
        return _body({f: {} for f in fields}, required, closed=False)

    def post(summary: str, req: Schema, ok: Schema | None = None, **kw: Any) -> Schema:
        kw.setdefault("errors", _API_ERRORS)
        answer = ok or {"200": _json(_OBJ)}
        return {
            "post": _op(summary, answer, tag="ollama", body=req, error="OllamaError",
                        security=_API_SECURITY, **kw)
        }  # fmt: skip

    def get(summary: str) -> Schema:
        ok = {"200": _json(_OBJ)}
        return {
            "get": _op(summary, ok, tag="ollama", errors=(401, 503), error="OllamaError",
                       security=_API_SECURITY)
        }  # fmt: skip

    ndjson: Schema = {
        "200": {
            "description": "NDJSON lines (stream unset or true), or one JSON object",
            "content": {
                "application/x-ndjson": {"schema": _OBJ},
                "application/json": {"schema": _OBJ},
            },
        }
    }
    generation = ("model", "format", "options", "stream", "think", "keep_alive")
    generate = ("prompt", "suffix", "images", "system", "template", "context", "raw")
    embed = ("model", "input", "truncate", "options", "keep_alive")
    return {
        "/api/chat": post("Chat (Ollama)", body(*generation, "messages", "tools"), ndjson),
        "/api/generate": post("Generate (Ollama)", body(*generation, *generate), ndjson),
        "/api/embed": post("Embeddings (Ollama)", body(*embed, required=("model", "input"))),
        "/api/embeddings": post(
            "Embedding, legacy (Ollama)",
            body("model", "prompt", "options", "keep_alive", required=("model", "prompt")),
        ),
        "/api/show": post(
            "One model's details (Ollama)",
            body("model", "name", required=()),
            errors=(400, 401, 403, 404, 503),
        ),
        "/api/pull": post(
            "Pull a model (Ollama; the admin token only): hf.co/ORG/REPO[:QUANT] or a .gguf "
            "URL, onto the box's pulls; NDJSON progress unless stream is false",
            body("model", "name", "stream", "insecure", required=()),
            errors=(400, 401, 403, 409, 429, 500, 503),
        ),
        "/api/tags": get("Models and policies this key may use (Ollama)"),
        "/api/ps": get("Resident models this key may use (Ollama)"),
        "/api/version": get("The Ollama API version spoken (Ollama)"),
    }


@cache
def document() -> Schema:
    """The whole document (built once per process: it depends on code only)."""
    schemas = {
        **SCHEMAS,
        "ResponseRequest": _responses_body(),
        "MessageRequest": _messages_body(count=False),
        "CountTokensRequest": _messages_body(count=True),
        "OllamaError": _OLLAMA_ERROR,
        "SettingsSchema": _settings_schema(),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "residency",
            "version": VERSION,
            "description": "A shared LLM inference box: the OpenAI API (chat, completions, "
            "embeddings, models, responses), Anthropic's Messages API, and admin and "
            "operations endpoints.",
        },
        "paths": {**_api_paths(), **_ollama_paths(), **_admin_paths(), **_ops_paths()},
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key; on /admin/* the admin key or an admin token",
                },
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "an API key (what Anthropic clients send)",
                },
            },
        },
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(document())
