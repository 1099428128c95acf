"""Turning the last position's logits into the next token: greedy, or temperature / top-k / top-p sampling.

Sampling is Gumbel-max on float32 logits, so no temperature the API accepts can overflow it: temperatures below
MIN_TEMPERATURE are greedy, non-finite logits are clamped, and nothing is ever drawn from a distribution that does
not sum to one (torch.multinomial raised on those). A row that still fails (its generator broke, or its scores are
NaN: a temperature the engine's validation would have refused) is named in SamplingError, so the caller fails that
sequence alone.

The whole batch is sampled at once on the logits' device: one argmax when every row is greedy; otherwise one small
host->device copy of the rows' settings, one temperature division, one sort for the rows with top-k or top-p, one
noise draw for the unseeded rows and one device->host transfer. Only seeded rows cost a call each: a row's noise
comes from its own generator, so its tokens depend on its seed alone, never on the rows it is batched with.
"""

from __future__ import annotations

import math

import torch

from rank_worker.engine.interface import SamplingParams

# Below this a temperature makes every logit gap of 1e-3 or more a certainty: greedy, without the division
# (logits / 1e-40 overflows float32; the API accepts such values).
MIN_TEMPERATURE = 1e-5
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_EPS = torch.finfo(torch.float32).eps
_NO_TOKEN = -1  # a sampled row's token when its scores were NaN


class SamplingError(RuntimeError):
    """Sampling failed for some rows of the batch (indices into the logits); the other rows were fine."""

    def __init__(self, rows: list[int], cause: BaseException) -> None:
        super().__init__(f"sampling failed for row(s) {rows}: {cause!r}")
        self.rows = rows
        self.cause = cause


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < MIN_TEMPERATURE or params.top_k == 1


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [S, vocab], one row per sequence. Rows with a seed draw from their own generator.

    Raises SamplingError naming the rows that could not be sampled. The seeded generators are then put back as
    they were, so the other rows draw the same tokens when the step is retried without the failed ones."""
    pending = launch_sampling(logits, params, generators)
    tokens, failures = pending.read()
    if failures:
        pending.restore_generators()
        rows = sorted(failures)
        raise SamplingError(rows, failures[rows[0]])
    return tokens


class PendingTokens:
    """A batch's tokens drawn on the device and not read yet: `tokens` ([S] int64, on the logits' device) can
    feed the next step's input ids before the host has seen them. On CUDA they are copied into `host` (pinned)
    behind an event as soon as they are drawn, so read() waits for this step's work alone, not for whatever
    was launched after it."""

    def __init__(
        self,
        tokens: torch.Tensor,
        sampled: list[int],
        failures: dict[int, BaseException],
        generators: list[torch.Generator | None],
        states: dict[int, torch.Tensor],
        host: torch.Tensor | None = None,
    ) -> None:
        self.tokens = tokens
        self._sampled = sampled
        self._failures = failures
        self._generators = generators
        self._states = states
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            if host is None or host.numel() < tokens.numel():
                host = torch.empty(tokens.numel(), dtype=torch.int64, pin_memory=True)
            self._host = host[: tokens.numel()]
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def read(self) -> tuple[list[int], dict[int, BaseException]]:
        """The tokens, and the rows that could not be sampled (_NO_TOKEN in `tokens`) with why."""
        if self._ready is not None and self._host is not None:
            self._ready.synchronize()
            values = self._host.tolist()
        else:
            values = self.tokens.tolist()
        return _checked(values, self._sampled, dict(self._failures))

    def restore_generators(self) -> None:
        """Put the seeded rows' generators back as they were before this draw (for a retry without failed rows)."""
        _restore(self._generators, self._states)


def launch_sampling(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    host: torch.Tensor | None = None,
) -> PendingTokens:
    """Draw every row's token on the device without reading it back (sample_tokens reads at once). `host`: a
    pinned int64 buffer of at least S elements to read through (one is allocated when it is missing)."""
    sampled = [row for row, row_params in enumerate(params) if not is_greedy(row_params)]
    if not sampled:
        return PendingTokens(logits.argmax(dim=-1), [], {}, generators, {}, host)  # one argmax, one transfer
    states = {row: gen.get_state() for row in sampled if isinstance(gen := generators[row], torch.Generator)}
    try:
        tokens, failures = _sample_batch(logits, params, generators, sampled)
    except Exception:  # e.g. out of memory for the whole batch: row by row, so a failure is one row's again
        _restore(generators, states)
        tokens, failures = _sample_row_by_row(logits, params, generators, sampled)
    return PendingTokens(tokens, sampled, failures, generators, states, host)


def _sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], sampled: list[int]
) -> tuple[torch.Tensor, dict[int, BaseException]]:
    tokens = logits.argmax(dim=-1)  # the greedy rows' tokens; the sampled rows' are written over them
    failures = _sample_rows(logits, params, generators, sampled, tokens)
    return tokens, failures


def _sample_row_by_row(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], sampled: list[int]
) -> tuple[torch.Tensor, dict[int, BaseException]]:
    tokens = logits.argmax(dim=-1)
    failures: dict[int, BaseException] = {}
    for row in sampled:
        try:
            failures.update(_sample_rows(logits, params, generators, [row], tokens))
        except Exception as exc:  # one sequence's parameters or logits must not fail the whole batch
            failures[row] = exc
    return tokens, failures


def _checked(
    tokens: list[int], sampled: list[int], failures: dict[int, BaseException]
) -> tuple[list[int], dict[int, BaseException]]:
    for row in sampled:
        if tokens[row] == _NO_TOKEN and row not in failures:
            failures[row] = FloatingPointError("the row's scaled logits are NaN: there is no distribution to sample")
    return tokens, failures


def _sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rows: list[int],
    tokens: torch.Tensor,
) -> dict[int, BaseException]:
    """Sample `rows` into `tokens` (on the device, _NO_TOKEN where the scores are NaN); returns the rows whose
    generator failed."""
    vocab = logits.shape[-1]
    # One slice per group: the unseeded rows first (one noise draw), the rows with top-k or top-p in the middle
    # (one sort); a row's position in the batch changes nothing it computes.
    groups: tuple[list[int], ...] = ([], [], [], [])  # unseeded plain, unseeded filtered, seeded filtered, seeded plain
    for row in rows:
        seeded, filtered = generators[row] is not None, _filters(params[row], vocab)
        groups[(2 if filtered else 3) if seeded else (1 if filtered else 0)].append(row)
    order = [row for group in groups for row in group]
    unseeded = len(groups[0]) + len(groups[1])
    filtered = slice(len(groups[0]), unseeded + len(groups[2]))
    settings = torch.tensor(
        [[row, _temperature(params[row]), _top_k(params[row], vocab), _top_p(params[row])] for row in order],
        dtype=torch.float32,  # exact for row and k below 2**24; the old scalar temperature and top_p were float32 too
        pin_memory=logits.is_cuda,
    ).to(logits.device, non_blocking=True)  # from pageable memory this copy waited for the whole forward
    row_index = settings[:, 0].long()

    # Gumbel-max: argmax(logit + Gumbel noise) draws from softmax(logits) without forming the probabilities.
    # The uniform draw is kept off 0 and 1 so the noise is finite and a filtered (-inf) token never wins.
    noise = torch.empty((len(order), vocab), dtype=torch.float32, device=logits.device)
    if unseeded:
        noise[:unseeded].uniform_()
    failures: dict[int, BaseException] = {}
    for position in range(unseeded, len(order)):
        row = order[position]
        try:
            noise[position].uniform_(generator=generators[row])  # a call of its own: the seed decides it alone
        except Exception as exc:  # a broken generator fails its row only
            failures[row] = exc
    gumbel = noise.clamp_(_FLOAT32_TINY, 1.0 - _FLOAT32_EPS).log_().neg_().log_().neg_()

    chosen = logits if order == list(range(logits.shape[0])) else logits.index_select(0, row_index)
    scaled = torch.nan_to_num(chosen.float(), nan=float("-inf"), posinf=_FLOAT32_MAX)
    scaled = scaled.div_(settings[:, 1:2]).clamp_(min=None, max=_FLOAT32_MAX)
    if filtered.start < filtered.stop:
        any_top_p = any(_top_p(params[row]) < math.inf for row in order[filtered])
        _apply_top_k_top_p(scaled[filtered], settings[filtered, 2:3].long(), settings[filtered, 3:4], any_top_p)
    scores = scaled.add_(gumbel)
    picked = scores.argmax(dim=-1).masked_fill_(scores.isnan().any(dim=-1), _NO_TOKEN)
    tokens.index_copy_(0, row_index, picked)
    return failures


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_p: bool) -> None:
    """Filter each row of `scaled` in place to its top_k ([n, 1]; vocab = off) and top_p ([n, 1]; inf = off)."""
    # stable: tied logits keep the vocabulary's order, so which of them top-p drops does not depend on the batch
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    kth = sorted_logits.gather(1, top_k - 1)  # ties with the k-th largest stay, as torch.topk's threshold kept them
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if any_top_p:
        # float64: the GPU's cumsum rounds by a thread layout it picks from the number of rows (one row goes to
        # cub), which in float32 could move a seeded row's nucleus with its batch; in float64 that is ~1e-16.
        probs = sorted_logits.softmax(dim=-1).double()
        # drop a token once the ones before it already reach top_p; the first token always stays, even for a
        # top_p that float32 rounds to 0
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    scaled.scatter_(1, order, sorted_logits)


def _filters(params: SamplingParams, vocab: int) -> bool:
    return _top_k(params, vocab) < vocab or _top_p(params) < math.inf


def _temperature(params: SamplingParams) -> float:
    # a finite temperature past float32's range would become inf, and -inf / inf is NaN: flat, not failed
    return min(params.temperature, _FLOAT32_MAX)


def _top_k(params: SamplingParams, vocab: int) -> int:
    return params.top_k if 0 < params.top_k < vocab else vocab


def _top_p(params: SamplingParams) -> float:
    return params.top_p if 0.0 < params.top_p < 1.0 else math.inf


def _restore(generators: list[torch.Generator | None], states: dict[int, torch.Tensor]) -> None:
    for row, state in states.items():
        generator = generators[row]
        assert generator is not None
        generator.set_state(state)
