"""(name, help) of the series kiln serve exports that its Triton model (serving/triton_model.py)
exports too: one spelling, so the dashboard's panels read both servers.

A module of its own because Triton's Python backend stub cannot import prometheus_client
(serving/metrics.py): its embedded Python 3.11.2 fails to load the interpreter's `_ssl`."""

GENERATED_TOKENS = ("kiln_generated_tokens_total", "Tokens generated for clients.")
PROMPT_TOKENS = ("kiln_prompt_tokens_total", "Prompt tokens of the requests served (those a prefix cache gave included).")
QUEUE_DEPTH = ("kiln_queue_depth", "Sequences waiting for a batch slot.")
RUNNING_BATCH = ("kiln_running_batch_size", "Sequences in the running batch.")
DECODED_ROWS = ("kiln_decoded_rows_total", "Sequence rows advanced by decode steps.")
