"""`rag-kvcache eval`: answer quality and TTFT of every link strategy on a QA set, and a
needle-in-a-haystack sweep.

Each item's documents are encoded once, each alone (one chunk per document; LegoLink-0's
chunks again with sink tokens). Then for every strategy the chunks are linked after the system
prompt, the question is prefilled and the answer decoded greedily: F1 / exact match / answer
contained, TTFT (link + first token), tokens recomputed. Fidelity is measured against `full`
(every token recomputed, equal to a plain prefill): the strategy's cache is teacher-forced on
`full`'s answer and its next-token distributions compared (KL, top-1 agreement).

"Kept" is counted against prefill with the same placement: a strategy spelled `+reversed` is
compared with `prefill+reversed`, since placement is a choice prefill can make as well. The
noise-floor rows (prefill reordered) are compared with prefill as given. `in_retrieval_order`
puts each item's documents in the order a retriever returns them (best first), so that
`+reversed` means "most relevant nearest the question".

The modules, each imported by name (this package re-exports nothing):

- `dataset`: the QA set's items (`EvalItem`, `load_dataset`), in retrieval order if asked.
- `evaluator`: the `Evaluator` (one item through every strategy) and `run_eval` (a QA set,
  resumable), the strategy list (`DEFAULT_STRATEGIES`, `check_strategies`).
- `results`: the rows (`ItemResult`), their summary per strategy (`summarize`, against the
  `baseline` of the same placement) and its markdown table.
- `journal`: the `Journal` a killed run resumes from; rows read back from JSON and checked.
- `floor`: "kept" beside the noise floor (`against_floor`) and against another run
  (`other_run`, `kept_against`).
- `reuse`: an earlier report's rows reused (`reused_rows`) and reports read as one run
  (`combined`).
- `needle`: the needle-in-a-haystack items and where a prefill finds every needle.
- `plots`: the figures (speed vs quality, KL vs k, the needle heatmap).
- `report`: the report's extra sections (`comparisons`), its JSON form and its files.
"""
