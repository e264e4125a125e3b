"""OpenAI-style errors: the JSON body, the status's error type, and the handlers that give every refusal that shape
(this server's own `APIError`, FastAPI's validation and routing errors, and a bug, as a 500 that says nothing internal)."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ray.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               429: "rate_limit_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's error type: any other 4xx (404, 405, 413, ...) is the request's fault too."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after or (1 if status in (429, 503) else None)


async def _api_error(request: Request, e: APIError):
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return error_response(e.status, e.message, e.param, e.code, headers)


async def _http_error(request: Request, e: StarletteHTTPException):
    """FastAPI's own refusals (a body it cannot parse, an unknown path or method) in OpenAI's shape too."""
    message = str(e.detail)
    if e.status_code in (404, 405):  # as OpenAI words it: which URL and method
        message = f"{message}: {request.method} {request.url.path}"
    return error_response(e.status_code, message, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request"),
                          headers=getattr(e, "headers", None))


async def _unexpected(request: Request, e: Exception):
    """A bug, not the client's fault: an OpenAI-style 500 that says nothing internal (the log has it)."""
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "internal error; the server log has the details", code="internal_error")


async def _validation_error(request: Request, e: RequestValidationError):
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    loc = [str(x) for x in err["loc"] if x not in ("body", "query")]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return error_response(400, f"unknown field '{param}': not a field of this endpoint in OpenAI's API, nor one of "
                                   "the vLLM extras this server implements (docs/http-api.md lists them)", param, "unknown_parameter")
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" and "error" in err.get("ctx", {}) else err["msg"]
    return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value")


def install_handlers(app: FastAPI) -> None:
    """Every error the app raises, in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(RequestValidationError, _validation_error)
