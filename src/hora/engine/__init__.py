"""The engine: requests, handles, negotiation, fusion, response cache, timeline, stall inspection.

It knows buffers, dtypes and names; it knows no framework and no socket: bindings convert
their tensors to buffers, and transports move the bytes.
"""

from hora.engine.engine import Engine, EngineSettings
from hora.engine.request import Handle, Kind, Request, Signature

__all__ = ["Engine", "EngineSettings", "Handle", "Kind", "Request", "Signature"]
