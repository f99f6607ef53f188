"""What a round keeps: acceptance and commit, two of the round's steps (arXiv 2606.18394, section 3.3; `docs/design.md`,
"§2 The round").

- [`accept`]: the deepest node whose whole path equals the target's own choices, plus the target's next token (the
  bonus), vectorized on the device for greedy without processors (on a CPU, the same rule walked on the host over
  the target's choices, read once), else a walk down each row's tree;
- [`commit`]: each row's tokens enter its sequence through the stopping criteria, and each token's source (who
  proposed it, `calibration.committed_sources`) enters the call's statistics.

Lossless: every committed token is the target's own choice (argmax, or a sample of the processed distribution)
given exactly the committed tokens before it, whatever the head drafts. The call's logits processors as they act on
one row (what [`accept`] asks through `Call.choose`) are in `processors.py`; how the stopping criteria are judged
for [`commit`], in `stopping.py`.
"""

from dataclasses import replace

import torch

from .calibration import committed_sources
from .state import Acceptance, Call, Committed, DraftTrees, JetSpecStats
from .stopping import judged_alone, stop_marks


def accept(logits: torch.Tensor, trees: DraftTrees, rows, choose=None, stops=None) -> Acceptance:
    """The deepest node whose path equals the target's own choices, and the target's token after it (the bonus).

    Greedy without logits processors (`choose is None`) is vectorized over rows and nodes, on the device: the
    target's argmax after every node, a node matches when its token is its parent's argmax, a node survives when it
    and all its ancestors match, the deepest survivor ends the path. Otherwise (sampling, processors) each row walks
    its tree from the root: `choose(row, node_logits, path)` is the target's token after `path` (processors see
    exactly the committed tokens plus the path), and the walk moves to the child holding it (sample-then-match).

    Args:
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`].
        trees (`DraftTrees`): the trees verified.
        rows (`list[int]` or `torch.LongTensor` of shape `(A,)`): the batch row of each tree (what `choose` is told).
        choose (`Callable`, *optional*): `(row, logits (V,), path tokens) -> (token, scores (V,))`.
        stops (`list`, *optional*): the call's criteria judged on the device (`Call.device_stops`); greedy acceptance
            on the host judges them on every node's choice and reads the verdicts with the choices (one read).

    Returns:
        `Acceptance` of width `K` = the trees' deepest depth + 1 (a bound known without reading the device), padded
        past each row's count; [`commit`] reads it and cuts it to the longest path.
    """
    if choose is None:
        if logits.device.type == "cpu" and trees.host is not None:
            return _accept_greedy_on_host(logits, trees, stops)
        return _accept_greedy(logits, trees)
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if trees.host is not None:
        shapes = [(tree.tokens, tree.parents) for tree in trees.host]
    else:
        shapes = list(zip(trees.tokens.tolist(), trees.parents.tolist()))
    walks = [
        _walk(logits[i], tokens, parents, row, choose) for i, (row, (tokens, parents)) in enumerate(zip(rows, shapes))
    ]
    a, width = len(walks), max(len(nodes) for nodes, _, _ in walks)
    padded = torch.zeros(2, a, width, dtype=torch.long)  # accepted nodes, committed tokens
    for i, (nodes, path, _) in enumerate(walks):
        padded[0, i, : len(nodes)], padded[1, i, : len(path)] = torch.tensor(nodes), torch.tensor(path)
    count = torch.tensor([len(nodes) for nodes, _, _ in walks], device=logits.device)
    return Acceptance(
        padded[0].to(logits.device),
        padded[1].to(logits.device),
        count,
        [s for _, _, s in walks],
        host=[(nodes, path) for nodes, path, _ in walks],
    )


def first_argmax(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """`logits.argmax(-1)`, the same index (the first maximal one on ties, the first NaN where there is one), read
    in two passes that CPU kernels run several times faster over a vocabulary.

    A reduction that returns an index is slow on a CPU; `amax` is not. So the last dimension is cut into chunks of
    `chunk` (the rest, shorter, is one more chunk): `amax` of each chunk, then the first chunk holding the largest of
    them, then the first maximal index inside that chunk alone. The first chunk that holds the maximum holds its first
    index, and a NaN, which both `amax` and `max` propagate, is found the same way. Measured with the round's verify
    logits, `(1, 17, 49152)`, 2 threads, AVX-512 + bf16 AMD host: float32 0.72 -> 0.10 ms, bf16 0.73 -> 0.33 ms
    (`logits.max(-1).indices`, itself faster than `argmax` in bf16).
    """
    v = logits.shape[-1]
    whole = v - v % chunk
    if whole < 2 * chunk:  # a short last dimension: one pass is as fast
        return logits.max(-1).indices
    flat = logits.reshape(-1, v)
    body = flat[:, :whole].reshape(flat.shape[0], whole // chunk, chunk)  # (R, C, chunk)
    peaks = body.amax(-1)  # (R, C)
    rest = flat[:, whole:].max(-1, keepdim=True) if whole < v else None  # the rest, one more chunk
    if rest is not None:
        peaks = torch.cat([peaks, rest.values], dim=1)
    best = peaks.max(-1).indices  # (R,): the first chunk holding the maximum
    inside = body.gather(1, best.clamp(max=body.shape[1] - 1)[:, None, None].expand(-1, 1, chunk))[:, 0]
    index = best * chunk + inside.max(-1).indices
    if rest is not None:
        index = torch.where(best == body.shape[1], whole + rest.indices[:, 0], index)
    return index.reshape(logits.shape[:-1])


def _accept_greedy(logits: torch.Tensor, trees: DraftTrees) -> Acceptance:
    a, n1 = logits.shape[:2]
    device = logits.device
    choice = first_argmax(logits)  # (A, n + 1), in the logits' own dtype (no fp32 copy of the vocabulary)
    matches = torch.cat(  # (A, n + 1): the node's token is what the target chose after its parent
        [torch.ones(a, 1, dtype=torch.bool, device=device), trees.tokens == choice.gather(1, trees.parents)], dim=1
    )
    alive = ~(trees.ancestors & ~matches[:, None, :]).any(-1)  # (A, n + 1): the whole path matches
    deepest = torch.where(alive, trees.depths, -1).argmax(-1)  # (A,)
    on_path = trees.ancestors[torch.arange(a, device=device), deepest]  # (A, n + 1)
    count = on_path.sum(-1)  # (A,)
    order = torch.where(on_path, torch.arange(n1, device=device), n1).sort(-1).values  # accepted nodes first
    nodes = order[:, : min(trees.max_depth() + 1, n1)]  # a path holds at most one node per depth
    nodes = nodes.masked_fill(nodes == n1, 0)  # (A, K)
    return Acceptance(nodes, choice.gather(1, nodes), count)


def _accept_greedy_on_host(logits: torch.Tensor, trees: DraftTrees, stops=None) -> Acceptance:
    """[`_accept_greedy`] with the target's choices read once and the trees walked on the host (the trees' own lists):
    on a CPU the vectorized version's two dozen small tensor ops cost more than the read, which is free there, and
    the walk. The same nodes, tokens and counts: a node is alive when its parent is and its token is its parent's
    choice; the path ends at the first alive node of the largest depth. The device criteria `stops` (each reads a
    row's last token alone, `stopping.DEVICE_STOPS`) are judged on every node's choice and read with the choices, so
    the round still reads the device once here (`Acceptance.marks`, the verdicts along each path)."""
    choice = first_argmax(logits)  # (A, n + 1)
    verdicts = None
    if stops:
        n1 = choice.shape[1]
        packed = torch.cat([choice, judged_alone(stops, choice).long()], dim=1).tolist()  # (A, 2 (n + 1)): one read
        choices, verdicts = [row[:n1] for row in packed], [row[n1:] for row in packed]
    else:
        choices = choice.tolist()
    walks = []
    for tree, choice in zip(trees.host, choices):
        alive, best = [True], 0  # the root; the deepest alive node so far (the first of its depth)
        for node, (token, parent, depth) in enumerate(zip(tree.tokens, tree.parents, tree.depths), start=1):
            alive.append(alive[parent] and token == choice[parent])
            if alive[node] and depth > (tree.depths[best - 1] if best else 0):
                best = node
        path = [best]
        while path[-1]:
            path.append(tree.parents[path[-1] - 1])
        nodes = path[::-1]  # root first
        walks.append((nodes, [choice[node] for node in nodes]))
    width = max(len(nodes) for nodes, _ in walks)
    padded = torch.zeros(2, len(walks), width, dtype=torch.long)  # accepted nodes, committed tokens; 0 past a count
    for i, (nodes, tokens) in enumerate(walks):
        padded[0, i, : len(nodes)], padded[1, i, : len(tokens)] = torch.tensor(nodes), torch.tensor(tokens)
    count = torch.tensor([len(nodes) for nodes, _ in walks])
    marks = None if verdicts is None else [[bool(row[n]) for n in nodes] for row, (nodes, _) in zip(verdicts, walks)]
    return Acceptance(padded[0], padded[1], count, host=walks, marks=marks)


def _walk(logits: torch.Tensor, tokens: list, parents: list, row: int, choose) -> tuple[list, list, list]:
    """One row's walk down its tree (`logits` of shape `(n + 1, V)`). Returns its accepted nodes, committed tokens
    and the scores each token was chosen from."""
    kids = [{} for _ in range(len(tokens) + 1)]  # node -> {token: child}; the first child holding a token wins
    for child, (token, parent) in enumerate(zip(tokens, parents), start=1):
        kids[parent].setdefault(token, child)
    node, nodes, path, scores = 0, [0], [], []
    while True:
        token, processed = choose(row, logits[node], path)
        path.append(token)
        scores.append(processed)
        node = kids[node].get(token)
        if node is None:
            return nodes, path, scores
        nodes.append(node)


def commit(
    call: Call,
    acc: Acceptance,
    logits: torch.Tensor,
    trees: DraftTrees | None = None,
    stats: JetSpecStats | None = None,
) -> Committed:
    """Append each active row's accepted tokens to its sequence, through the stopping criteria, so a row stops
    exactly where plain decoding would, even inside an accepted path. A stopped row leaves the batch when an EOS
    criterion exists (plain decoding pads it); otherwise it goes on until every row has stopped ([`Call.finished`]).

    The round's one read: the acceptance (counts, nodes, tokens) and the verdicts of the criteria judged on the
    device (`stopping.stop_marks`) come to the host together; what follows is host work, and one write of every row's
    tokens to `call.sequences`. With a criterion that is not judged on the device (`stopping.stop_plan`) each committed
    token is checked on its own, a read per token.

    Args:
        acc (`Acceptance`): from [`accept`], one row per entry of `call.active`.
        logits (`torch.Tensor` of shape `(A, n + 1, V)`): from [`verify`] (kept with `output_logits`).
        trees (`DraftTrees`, *optional*): the trees verified, whose `head_tokens` and `branches` tell who proposed
            each accepted token (`calibration.committed_sources`); None: every committed token is the target's
            own (the prefill's).
        stats (`JetSpecStats`, *optional*): where each committed token's source is recorded (`token_sources`).
    """
    rows = call.active
    stops = stop_marks(call, acc) if acc.marks is None else None  # (A, K) bool, or None (judged with the acceptance)
    counts, paths, tokens, marks = _read_acceptance(acc, stops)
    committed, new = 0, {}
    for i, row in enumerate(rows):
        records = _records(acc, logits, i, paths[i]) if call.records is not None else None
        if call.device_stops is None or row in call.row_stopping:  # checked token by token, on the device
            taken = _commit_row(call, row, tokens[i], records)
        else:
            taken = _taken(call, row, marks[i] if marks is not None else None, counts[i])
            new[row] = tokens[i][:taken]
            if records is not None:
                call.records[row] += records[:taken]
        if stats is not None:
            stats.add_sources(row, _sources(trees, i, tokens[i])[:taken])
        committed += taken
    call.extend(new)
    keep = [i for i, row in enumerate(rows) if not call.finished(row)]  # after every row: a stop ends others
    call.active = [rows[i] for i in keep]
    if stats is not None and not keep:  # the call's last commit: its sources end where the output does
        stats.cut_sources(call.lengths, call.end())
    width = max(counts)  # every path fits; a shorter one leaves holes that `compact` masks
    return Committed(
        committed,
        counts,
        paths,
        torch.tensor(keep, dtype=torch.long, device=acc.count.device),
        replace(acc, nodes=acc.nodes[:, :width], tokens=acc.tokens[:, :width]),
    )


def _sources(trees: DraftTrees | None, i: int, tokens: list) -> list:
    """The source of each token tree `i` commits (`tokens`: its accepted path, then the bonus), from the host data
    the draft kept: no read."""
    if trees is None:  # the prefill's token
        return ["target"] * len(tokens)
    head_tokens = trees.head_tokens[i] if trees.head_tokens is not None else None
    trie = trees.branches[i] if trees.branches is not None else None
    answers = trees.answers[i] if trees.answers is not None else None
    return committed_sources(head_tokens, trie, tokens, answers)


def _read_acceptance(acc: Acceptance, stops: torch.Tensor | None) -> tuple[list, list, list, list | None]:
    """`(counts, paths, tokens, marks)` on the host, per row: accepted nodes, their indices, the committed tokens
    and the stop verdicts after each; one read (none when the walk chose on the host and nothing is judged on the
    device)."""
    k = acc.nodes.shape[1]
    if acc.host is not None:
        paths, tokens = [nodes for nodes, _ in acc.host], [path for _, path in acc.host]
        marks = acc.marks if acc.marks is not None else stops.tolist() if stops is not None else None
        return [len(p) for p in paths], paths, tokens, marks
    parts = [acc.count[:, None], acc.nodes, acc.tokens] + ([stops.long()] if stops is not None else [])
    packed = torch.cat(parts, dim=1).tolist()  # (A, 1 + 2K (+ K))
    counts = [row[0] for row in packed]
    paths = [row[1 : 1 + c] for row, c in zip(packed, counts)]
    tokens = [row[1 + k : 1 + k + c] for row, c in zip(packed, counts)]
    marks = [row[1 + 2 * k :] for row in packed] if stops is not None else None
    return counts, paths, tokens, marks


def _records(acc: Acceptance, logits: torch.Tensor, i: int, nodes: list) -> list:
    """`(scores, logits)` in fp32 of each token row `i` commits (the scores are the logits when greedy without
    processors, as in plain decoding)."""
    node_logits = [logits[i, node].float() for node in nodes]
    scores = acc.scores[i] if acc.scores is not None else node_logits
    return list(zip(scores, node_logits))


def _taken(call: Call, row: int, marks: list | None, count: int) -> int:
    """How many of its `count` accepted tokens `row` commits, and where it stops (host data: `marks[k - 1]` is the
    device criteria's verdict after the k-th token, `call.stop_length` the max-length criterion's length)."""
    length = call.lengths[row]
    for k in range(1, count + 1):
        if call.stopped_at[row] is None and (
            (marks is not None and marks[k - 1]) or (call.stop_length is not None and length + k >= call.stop_length)
        ):
            call.stopped_at[row] = length + k  # a stop is final, as `unfinished_sequences` in plain decoding
        if call.stopped_at[row] is not None and (call.pads_finished or length + k >= call.max_length):
            return k
    return count


def _commit_row(call: Call, row: int, tokens: list, records: list | None) -> int:
    """Append `tokens` to `row` one at a time, the stopping criteria checked after each until one stops the row;
    a stopped row takes no more when finished rows are padded, or past `max_length`. Returns the tokens committed."""
    start = call.lengths[row]
    for added, token in enumerate(tokens, start=1):
        call.append(row, token)
        if records is not None:
            call.records[row].append(records[added - 1])
        # a stop is final, as `unfinished_sequences` in plain decoding
        if call.stopped_at[row] is None and call.judge(row):
            call.stopped_at[row] = call.lengths[row]
        if call.stopped_at[row] is not None and (call.pads_finished or call.lengths[row] >= call.max_length):
            break
    return call.lengths[row] - start
