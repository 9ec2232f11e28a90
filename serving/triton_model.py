"""A kiln engine inside NVIDIA Triton Inference Server: the Python backend model that
`kiln export triton` copies into a model repository as `<name>/<version>/model.py`.

It runs in Triton's Python backend stub (an environment with kiln, onnxruntime and
tokenizers: `make triton-env`), beside the engine directory copied next to it. At load it
checks the engine file against the sha256 the export recorded from the registry, and
refuses to load otherwise (Triton then reports the model not ready). Requests are Triton's
generate extension (`text_input`, `max_tokens`, `temperature`, `top_p`, `seed`, `stream`,
`ignore_eos`; `text_output`, `finish_reason`), decoupled so a stream sends its text as it
is generated, and they share the engine's decode steps through kiln's own
continuous-batching scheduler, as in `kiln serve`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # Triton's own module, present only inside its Python backend

from components.engine_dir import load_engine_dir
from components.runtime.onnxruntime import keep_freed_memory
from components.runtime import open_engine
from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from registry import tags
from serving.series import DECODED_ROWS, GENERATED_TOKENS, PROMPT_TOKENS, QUEUE_DEPTH, RUNNING_BATCH
from serving.scheduler import Delta, Failed, Finished, Scheduler, Sequence, Turn

ENGINE_DIR = "engine"  # beside model.py in the version's folder
IDENTITY_FILE = "kiln_version.json"  # what the registry recorded for this version (written by the export)
DEFAULTS = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        here = Path(args["model_repository"]) / args["model_version"]
        identity = json.loads((here / IDENTITY_FILE).read_text())
        engine_dir = load_engine_dir(here / ENGINE_DIR)  # engine.json readable, files present, its own sha256
        recorded = identity[tags.ENGINE_SHA256]
        if engine_dir.sha256 != recorded:
            raise pb_utils.TritonModelException(
                f"{identity['model']} version {identity['version']} refused: its engine file has sha256 {engine_dir.sha256[:12]}…, the registry recorded {recorded[:12]}…"
            )
        parameters = json.loads(args["model_config"]).get("parameters", {})
        threads = int(parameters.get("kiln.threads", {}).get("string_value", "1"))
        max_waiting = int(parameters.get("kiln.max_waiting", {}).get("string_value", "64"))
        self.tokenizer = EngineTokenizer(engine_dir.path)
        keep_freed_memory()  # as kiln serve's engine process does
        engine = open_engine(engine_dir, threads=threads)
        engine.generate([[engine.manifest.eos_token_id]], Sampling(max_new_tokens=2, stop_at_eos=False))  # warm, as kiln serve does
        engine.prepare_to_serve()
        self.metrics = _KilnMetrics({"model": identity["model"], "version": identity["version"]})
        self.scheduler = Scheduler(engine, self.tokenizer, max_waiting, observe=self.metrics.observe)
        pb_utils.Logger.log_info(f"kiln: serving {identity['model']} version {identity['version']} ({identity[tags.PRECISION]}, sha256 {engine_dir.sha256[:12]}…)")

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.scheduler.submit([self._sequence(request, sender)])
            except Exception as err:  # a prompt beyond the profile, a full line, bad values: this request alone
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self) -> None:
        self.scheduler.close(timeout=30)

    def _sequence(self, request, sender) -> Sequence:
        text = _input(request, "text_input")
        if text is None:
            raise ValueError("text_input is required")
        prompt = self.tokenizer.encode_prompt(text.decode() if isinstance(text, bytes) else str(text))
        if not prompt:
            raise ValueError("text_input encodes to no tokens")
        given = {name: value for name in ("max_tokens", "temperature", "top_p", "seed", "stream", "ignore_eos") if (value := _input(request, name)) is not None}
        stream = bool(given.get("stream", False))
        sampling = Sampling(
            max_new_tokens=int(given.get("max_tokens", DEFAULTS["max_tokens"])),
            temperature=float(given.get("temperature", DEFAULTS["temperature"])),
            top_p=float(given.get("top_p", DEFAULTS["top_p"])),
            seed=int(given["seed"]) if "seed" in given else None,
            stop_at_eos=not bool(given.get("ignore_eos", False)),  # vLLM's extension (benchmarks)
        )
        sequence = Sequence(prompt, sampling, lambda event: self._answer(sender, sequence, event, stream), stream=stream)
        return sequence

    def _answer(self, sender, sequence: Sequence, event, stream: bool) -> None:
        """Called on the scheduler's thread: a stream's new text as it comes; the whole text
        (or the finish) once the sequence ends."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if isinstance(event, Delta) and event.text:
            sender.send(_text_response(event.text, None))
        elif isinstance(event, Finished):
            self.metrics.finished(event)
            sender.send(_text_response("" if stream else sequence.text, event.reason), flags=final)
        elif isinstance(event, Failed):
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(event.message)), flags=final)


class _KilnMetrics:
    """Some of kiln serve's own series, beside Triton's nv_inference_* on its /metrics port
    (Triton's custom metrics), under the same names, so their panels read Triton too."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._families = []  # a family must outlive its metrics (Triton deletes their values with it)

        def family(name: str, help_: str, kind):
            self._families.append(pb_utils.MetricFamily(name=name, description=help_, kind=kind))
            return self._families[-1].Metric(labels=labels)

        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._running, self._waiting = family(*RUNNING_BATCH, gauge), family(*QUEUE_DEPTH, gauge)
        self._rows, self._generated, self._prompt = family(*DECODED_ROWS, counter), family(*GENERATED_TOKENS, counter), family(*PROMPT_TOKENS, counter)

    def observe(self, turn: Turn) -> None:
        """Each turn of the scheduler."""
        self._safely(lambda: (self._running.set(turn.running), self._waiting.set(turn.waiting), turn.decoded and self._rows.increment(turn.decoded)))

    def finished(self, event: Finished) -> None:
        self._safely(lambda: (self._generated.increment(event.completion_tokens), self._prompt.increment(event.prompt_tokens)))

    def _safely(self, update) -> None:
        """A metric Triton refuses must not stop the scheduler's thread: said once, then skipped."""
        if self._families is None:
            return
        try:
            update()
        except pb_utils.TritonModelException as err:
            pb_utils.Logger.log_warn(f"kiln: metrics stopped: {err}")
            self._families = None


def _text_response(text: str, finish_reason: str | None):
    outputs = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
    if finish_reason is not None:
        outputs.append(pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)))
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0]

