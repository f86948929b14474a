"""The Gateway API Inference Extension's endpoint-picker protocol, as Envoy ext_proc messages (pure).

A Gateway (GKE, kgateway, Istio) that routes to an InferencePool asks the pool's endpoint picker, over
Envoy's external processing gRPC stream, where each request goes. The protocol
(gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):

- the proxy MAY name the endpoints to choose from in the request's filter metadata,
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of ``ip:port``); the picker
  MUST then pick among those only, and answer 503 when none is eligible;
- the picker answers with the header ``x-gateway-destination-endpoint`` and the same value in its dynamic
  metadata, ``envoy.lb`` / ``x-gateway-destination-endpoint``: ``ip:port`` or ``ip:port,ip:port,...``,
  the first one primary, the rest the fallbacks the proxy tries in order on a retry;
- no endpoint: an ImmediateResponse 503 (429 to shed load).

The messages are the published Envoy protos (``xds-protos``: envoy.service.ext_proc.v3); this module
reads and builds them and decides nothing. extproc.py holds the stream and the decision.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"


def headers_of(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """The request's headers, names lower-cased; Envoy sends values as ``raw_value`` bytes (or ``value``)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def subset_hint(request: ext_proc.ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows (``ip:port``), or None when it named none (pick from the pool)."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    field = meta[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if field is None:
        return None
    kind = field.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in field.list_value.values if v.string_value]
    if kind == "string_value":  # tolerated: one endpoint, or a comma-separated list
        return [s.strip() for s in field.string_value.split(",") if s.strip()]
    return []


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint that served the request (the proxy reports it on the response path), if it says."""
    meta = request.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in meta:
        return None
    field = meta[DESTINATION_NAMESPACE].fields.get(SERVED_KEY)
    return field.string_value or None if field is not None else None


def endpoint_of(upstream: str) -> str:
    """``http://10.0.0.7:11556`` -> ``10.0.0.7:11556`` (the protocol's form)."""
    parts = urlsplit(upstream)
    return parts.netloc or upstream


def upstream_of(endpoint: str) -> str:
    """``10.0.0.7:11556`` -> the router's upstream URL for it."""
    return f"http://{endpoint}"


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("utf-8")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _mutation(set_headers: Mapping[str, str], remove: Iterable[str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[_header(k, v) for k, v in set_headers.items()], remove_headers=list(remove)
    )


def destination_metadata(endpoints: Sequence[str]) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: ",".join(endpoints)}})
    return meta


def picked(
    endpoints: Sequence[str],
    *,
    set_headers: Mapping[str, str] | None = None,
    remove_headers: Iterable[str] = (),
    on_body: bool = False,
) -> ext_proc.ProcessingResponse:
    """The answer naming ``endpoints`` (primary first): the header, the same value in the dynamic metadata,
    and the route cache cleared so the proxy routes on them. ``on_body``: as the answer to the request
    body (buffered mode) rather than to its headers."""
    common = ext_proc.CommonResponse(
        header_mutation=_mutation(
            {DESTINATION_HEADER: ",".join(endpoints), **(set_headers or {})}, remove_headers
        ),
        clear_route_cache=True,
    )
    meta = destination_metadata(endpoints)
    if on_body:
        return ext_proc.ProcessingResponse(
            request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=meta
        )
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=meta
    )


def headers_continue(*, response: bool = False) -> ext_proc.ProcessingResponse:
    """Let headers through unchanged (buffered mode's request headers, or the response's)."""
    answer = ext_proc.HeadersResponse(response=ext_proc.CommonResponse())
    if response:
        return ext_proc.ProcessingResponse(response_headers=answer)
    return ext_proc.ProcessingResponse(request_headers=answer)


def body_chunk(body: bytes, end_of_stream: bool, *, response: bool = False) -> ext_proc.ProcessingResponse:
    """A body chunk handed back to the proxy in streamed (full duplex) mode, unchanged."""
    answer = ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
            )
        )
    )
    if response:
        return ext_proc.ProcessingResponse(response_body=answer)
    return ext_proc.ProcessingResponse(request_body=answer)


def body_continue(*, response: bool = False) -> ext_proc.ProcessingResponse:
    answer = ext_proc.BodyResponse(response=ext_proc.CommonResponse())
    if response:
        return ext_proc.ProcessingResponse(response_body=answer)
    return ext_proc.ProcessingResponse(request_body=answer)


def immediate(
    status: int, body: bytes | dict, headers: Mapping[str, str] | None = None
) -> ext_proc.ProcessingResponse:
    """An answer the proxy sends the client itself (401, 404, 429, 503), OpenAI-shaped."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = {"content-type": "application/json", **(headers or {})}
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(all_headers, ()),
            body=raw,
            details=f"vsurge-epp:{status}",
        )
    )


def body_mode(request: ext_proc.ProcessingRequest) -> str:
    """How the proxy sends the request body, from the stream's first message: ``buffered`` (whole, after
    an answer to the headers), ``none`` (never: pick on the headers) or ``streamed`` (FULL_DUPLEX_STREAMED,
    the protocol's mode, and the reading when the proxy says nothing: the picker answers the headers once
    the body is in, then hands the body back)."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    if not request.HasField("protocol_config"):
        return "streamed"
    mode = request.protocol_config.request_body_mode
    if mode == processing_mode_pb2.ProcessingMode.NONE:
        return "none"
    if mode in (
        processing_mode_pb2.ProcessingMode.BUFFERED,
        processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL,
    ):
        return "buffered"
    return "streamed"


def response_streamed(request: ext_proc.ProcessingRequest) -> bool:
    """Whether the proxy streams the response body through the picker (full duplex: each chunk must be
    handed back); the reading when it says nothing."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    if not request.HasField("protocol_config"):
        return True
    mode = request.protocol_config.response_body_mode
    return mode == processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
