"""The prototype behind kiln's torch-cuda backend (README.md here): its ablation bench, the
HF static-cache peer, the kiln engine's gate and load phases, the serving-step and PDL
measurements. Modules run on a GPU machine (`run_device.sh`); importing them needs torch
only."""
