"""Measurements of kiln's torch-cuda backend on a GPU machine (README.md here): the trained
model's gates and loads, the serving scheduler without HTTP, and A/Bs and a profile of the
one-row Triton step. `run_device.sh` runs them; importing them needs torch only."""
