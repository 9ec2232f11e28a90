"""The `torch-cuda` engine directory: an ExportedProgram, the tokenizer and engine.json.

Layout (mirrors kiln's engine-dir contract; names are the prototype's):

    model.pt2          torch.export.save of StaticKVGPT2.forward, caches as mutated inputs,
                       dynamic batch / tokens / attended length, static cache shape
    tokenizer.json     copied from the model directory when there is one
    engine.json        versions, GPU arch, dtype, profile (slots, context), sha256
    compile_cache/     optional: Inductor / Triton caches kept beside the engine
    mega_cache.bin     optional: torch.compiler.save_cache_artifacts() bytes

The program is an ExportedProgram, not an AOTInductor package: the loader compiles it
with Inductor on the serving machine (AOTI .pt2 loading segfaulted on the target
machine once, so it is not the primary path).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.export import Dim

from components.runtime.static_kv import GPT2Shape, StaticKVGPT2, causal_bias

ENGINE_FILE = "model.pt2"
MANIFEST = "engine.json"
MEGA_CACHE = "mega_cache.bin"


@dataclass(frozen=True)
class Profile:
    num_slots: int  # most sequences decoded at once (rows of the cache)
    max_context: int  # prompt + generated tokens per sequence


def export_program(model: StaticKVGPT2, profile: Profile) -> torch.export.ExportedProgram:
    """Export forward with the profile's cache shape baked in and the rest dynamic."""
    kc, vc = model.new_cache(profile.num_slots, profile.max_context)
    dev = model.wte.device
    # Example sizes: >= 2 everywhere, or export would specialise a size-1 dim to 1.
    B, P, A = min(2, profile.num_slots), 3, 16
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    pos = torch.arange(P, device=dev).expand(B, P).contiguous()
    bias = causal_bias(pos, torch.arange(A, device=dev), model.wte.dtype)
    last = torch.full((B,), P - 1, dtype=torch.long, device=dev)
    batch = Dim("batch", min=1, max=profile.num_slots)
    tokens = Dim("tokens", min=1, max=profile.max_context)
    attn = Dim("attn", min=1, max=profile.max_context)
    dynamic_shapes = {
        "input_ids": {0: batch, 1: tokens},
        "positions": {0: batch, 1: tokens},
        "attn_bias": {0: batch, 2: tokens, 3: attn},
        "last_index": {0: batch},
        "k_cache": None,
        "v_cache": None,
    }
    with torch.no_grad():
        ep = torch.export.export(model, (ids, pos, bias, last, kc, vc), dynamic_shapes=dynamic_shapes, strict=False)
    # torch.export.save writes the example inputs too, and those include the two
    # full-profile caches (1.2 GB at 16 slots x 1024 fp32): drop them.
    ep.example_inputs = None
    return ep


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def device_facts() -> dict:
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        facts |= {"gpu": torch.cuda.get_device_name(), "arch": f"sm_{major}{minor}"}
    return facts


def build_engine_dir(
    model: StaticKVGPT2, profile: Profile, out_dir: Path, *, tokenizer_dir: Path | None = None
) -> dict:
    """Export, save and describe; returns the manifest (also written as engine.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ep = export_program(model, profile)
    t_export = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.export.save(ep, out_dir / ENGINE_FILE)
    t_save = time.perf_counter() - t0
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_dir / name).exists():
                shutil.copy2(tokenizer_dir / name, out_dir / name)
    manifest = {
        "backend": "torch-cuda",
        "engine_file": ENGINE_FILE,
        "engine_sha256": _sha256(out_dir / ENGINE_FILE),
        "dtype": str(model.wte.dtype).removeprefix("torch."),
        "shape": asdict(model.shape),
        "profile": asdict(profile),
        "fused_gelu": model.fused_gelu,
        "linear_layout": model.linear_layout,
        **device_facts(),
        "export_s": round(t_export, 3),
        "save_s": round(t_save, 3),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def load_program(engine_dir: Path) -> tuple[torch.nn.Module, dict]:
    """The program as a callable module with StaticKVGPT2.forward's signature, and its manifest."""
    manifest = json.loads((engine_dir / MANIFEST).read_text())
    facts = device_facts()
    if torch.cuda.is_available() and "arch" in manifest and manifest["arch"] != facts.get("arch"):
        raise RuntimeError(f"engine built for {manifest['arch']}, this GPU is {facts.get('arch')}")
    ep = torch.export.load(engine_dir / ENGINE_FILE)
    return ep.module(), manifest


def shape_of(manifest: dict) -> GPT2Shape:
    return GPT2Shape(**manifest["shape"])
