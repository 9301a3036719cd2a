"""The research harness, outside the wheel: each study one command, run from the
checkout's root (`python experiments/ruler.py --help`).

- `replay/`: the paper's claims measured as tables T1-T7 (`python -m pagekv replay`);
- `peer/`: NVIDIA kvpress's own presses, run in a virtual environment of their own on
  the same token ids as ours;
- one script per study: `ruler` (RULER on lm-eval's task code), `reconstruct_ab` (the
  reconstruct scorer against the window scorer and KVzip), `pooling_search`,
  `needle_budgets`, `physical_rows` / `physical_memory_chart` / `pool_runs` (equal
  physical memory), `reconstruct_memory`, `answers_of_checkout` and `decode_agreement`
  (two checkouts' or dtypes' answers compared token by token).

It imports the library (`pagekv`); the library never imports it.
"""
