"""Served inference engines: teachers scored and a student sampled on an OpenAI-compatible
completions server (vLLM first), and the local servers groupflow starts and stops.

`ServedTeachers` is the teacher stage's scorer for served teachers: native trio, one request
per replica, every answer checked, errors by cause. `ServedGenerator` samples each group in one
request and has the server reload new weights in `sync_weights`. `VLLMServer` runs a local vLLM server from a
Hugging Face model folder with a bounded start-up, and always stops it. The HTTP client is the
`served` extra (`pip install 'groupflow[served]'`), imported by the first call, so this package
imports without it.
"""

from __future__ import annotations

from groupflow.impl.engines._http import is_url, served_root
from groupflow.impl.engines._served_generator import ServedGenerator
from groupflow.impl.engines._served_teachers import ServedTeachers
from groupflow.impl.engines._vllm_server import VLLMServer, free_port

__all__ = [
    "ServedGenerator",
    "ServedTeachers",
    "VLLMServer",
    "free_port",
    "is_url",
    "served_root",
]
