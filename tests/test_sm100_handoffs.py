"""The SM100 forward kernel's handoffs, run on the CPU as a model (issue 16: no Blackwell GPU here).

fa4_jax/kernels/fwd_sm100.py's roles -- the load warp, the MMA warp, one softmax warpgroup per Q tile
and the correction warpgroup -- talk only through mbarrier pipelines (cutlass.pipeline): a stage's
"full" barrier (producer -> consumer) and "empty" barrier (consumer -> producer), waited on with a
parity bit. A mistake in a stage index, a phase or an order there hangs the kernel or lets one role
overwrite a buffer another still reads, and nothing can run the kernel here to show it. So each
role is written below as a generator that performs, in the same order as the kernel's code, the
same pipeline operations with the same state arithmetic (cutlass's PipelineState: index, phase,
advance(n)), and touches tagged stand-ins of the buffers those operations guard (Q, the K and V
rings, S/P in Tensor Memory, O, the row-scale slots). Random interleavings of the roles must all
finish (no deadlock) and every read must see exactly the block's data it expects.

The stage counts and Q tiles per CTA come from the kernel's own configuration (config_sm100), for
one and two Q tiles per CTA (KV cache / dense and varlen at head_dim <= 128).
"""

from __future__ import annotations

import random

import pytest

from fa4_jax.kernels.config_sm100 import sm100_fwd_config


class State:
    """cutlass.pipeline.PipelineState: (index, phase); advance(n) wraps the index and flips the phase
    on each wrap. Producers start at phase 1 (their first acquire of an empty stage passes)."""

    def __init__(self, stages: int, producer: bool, index: int = 0):
        self.stages, self.index, self.phase = stages, index, 1 if producer else 0

    def advance(self, n: int = 1):
        self.index += n
        self.phase ^= (self.index // self.stages) % 2
        self.index %= self.stages


class Barrier:
    """An mbarrier with one expected arrival: wait(parity) passes once the phase of that parity has
    completed, i.e. while completed % 2 != parity (the first wait on parity 1 passes at once)."""

    def __init__(self):
        self.completed = 0

    def arrive(self):
        self.completed += 1


class Pipe:
    def __init__(self, stages: int):
        self.full = [Barrier() for _ in range(stages)]
        self.empty = [Barrier() for _ in range(stages)]

    # Each op a role waits on is a (barrier, parity) the scheduler polls.
    def producer_acquire(self, st):
        return self.empty[st.index], st.phase

    def producer_commit(self, st):
        self.full[st.index].arrive()

    def consumer_wait(self, st):
        return self.full[st.index], st.phase

    def consumer_release(self, st):
        self.empty[st.index].arrive()


class Cta:
    """The CTA's pipelines and tagged buffers, as `kernel` creates them, and the tiles it walks (the
    key blocks of each: a persistent CTA of full attention takes several, 0 blocks included)."""

    def __init__(self, q_stage: int, stages: int, tiles: list[int], gather: bool = False):
        self.q_stage, self.stages, self.tiles, self.gather = q_stage, stages, tiles, gather
        self.pipe_q = Pipe(q_stage)
        self.pipe_k, self.pipe_v = Pipe(stages), Pipe(stages)
        self.pipe_s, self.pipe_p = Pipe(2), Pipe(2)
        self.pipe_o = Pipe(q_stage)
        self.pipe_scale = Pipe(2 * q_stage)
        self.q = [None] * q_stage
        self.k, self.v = [None] * stages, [None] * stages
        self.s = [None] * 2  # S buffer b holds ("S", tile, q tile, block)
        self.p = [None] * 2  # its upper half, P of ("P", tile, q tile, block)
        self.o = [None] * q_stage  # (tile, blocks accumulated in order) of each Q tile's O
        self.o_ready = [None] * q_stage  # (tile, block) whose P.V the correction has rescaled / stored
        self.scale = [None] * (2 * q_stage)
        self.stored = []

    def busy(self):
        return [(i, n) for i, n in enumerate(self.tiles) if n > 0]


def block(n, j):
    return n - 1 - j  # blocks run from the highest down


def load(c: Cta):
    if c.gather:
        yield from load_gathered(c)
        return
    q_state, kv = State(c.q_stage, True), State(c.stages, True)
    for tile, n in c.busy():
        yield c.pipe_q.producer_acquire(q_state)
        c.q[q_state.index] = ("Q", tile, 0)
        c.pipe_q.producer_commit(q_state)
        q_state.advance()
        for i in range(n):
            yield c.pipe_k.producer_acquire(kv)
            c.k[kv.index] = ("K", tile, block(n, i))
            c.pipe_k.producer_commit(kv)
            if c.q_stage == 2 and i == 0:  # the second Q tile between the first K and V
                yield c.pipe_q.producer_acquire(q_state)
                c.q[q_state.index] = ("Q", tile, 1)
                c.pipe_q.producer_commit(q_state)
                q_state.advance()
            yield c.pipe_v.producer_acquire(kv)
            c.v[kv.index] = ("V", tile, block(n, i))
            c.pipe_v.producer_commit(kv)
            kv.advance()


def load_gathered(c: Cta):
    """FlashAttentionForwardSm100._load_gathered (KV cache, one-row page pieces; one tile per CTA):
    Q, then each block's K and V rows copied and their stages handed over one block late."""
    q_state, kv = State(1, True), State(c.stages, True)
    for tile, n in c.busy():
        yield c.pipe_q.producer_acquire(q_state)
        c.q[0] = ("Q", tile, 0)
        c.pipe_q.producer_commit(q_state)
        prev = State(c.stages, True)
        prev.index, prev.phase = kv.index, kv.phase
        for i in range(n):
            yield c.pipe_k.producer_acquire(kv)
            c.k[kv.index] = ("K", tile, block(n, i))
            if i > 0:  # the previous block's copies have landed
                c.pipe_k.producer_commit(prev)
                c.pipe_v.producer_commit(prev)
            yield c.pipe_v.producer_acquire(kv)
            c.v[kv.index] = ("V", tile, block(n, i))
            prev.index, prev.phase = kv.index, kv.phase
            kv.advance()
        c.pipe_k.producer_commit(prev)
        c.pipe_v.producer_commit(prev)


def _qk(c: Cta, tile: int, n: int, t: int, j: int, buf: int, kv_index: int):
    """S_t = Q_t K_j^T into S buffer `buf`: this tile's Q_t and K_j must be there, and the P it
    overwrites must have been read by its P.V gemm (issued earlier by the same thread: the tensor
    core runs them in order), which `_pv` records by clearing it."""
    assert c.q[t] == ("Q", tile, t), (c.q, tile, t)
    assert c.k[kv_index] == ("K", tile, block(n, j)), (c.k, kv_index, tile, j)
    assert c.p[buf] is None, ("S overwrites an unread P", buf, c.p[buf])
    c.s[buf] = ("S", tile, t, j)


def _pv(c: Cta, tile: int, n: int, t: int, j: int, buf: int, v_index: int, prev_tile):
    """O_t (+)= P_t(j) V_j: P of this tile, Q tile and block, V_j, and O_t rescaled up to block j - 1
    (j = 0: the previous tile's O_t stored, as it is overwritten)."""
    assert c.p[buf] == ("P", tile, t, j), ("P", buf, c.p[buf], tile, t, j)
    assert c.v[v_index] == ("V", tile, block(n, j)), (c.v, v_index, tile, j)
    if j == 0:
        assert c.o_ready[t] == prev_tile, ("O overwritten", t, c.o_ready[t])
        c.o[t] = (tile, [0])
    else:
        assert c.o_ready[t] == (tile, j - 1), ("O not rescaled", t, j, c.o_ready)
        c.o[t][1].append(j)
    c.p[buf] = None


def mma(c: Cta, parity: bool = False):
    """`parity`: S and P buffers chosen by the block's parity (j % 2), as the one-tile kernel did
    until 2026-12-05, instead of the pipeline stage -- a mutant for the test below."""
    q_state = State(c.q_stage, False)
    kv, vs = State(c.stages, False), State(c.stages, False)
    s_state, p_state, o_state = State(2, True), State(2, False), State(c.q_stage, True)
    prev = None  # (tile, last block) of the CTA's previous tile with keys
    for tile, n in c.busy():
        if c.q_stage == 1:  # FlashAttentionForwardSm100.mma
            yield c.pipe_q.consumer_wait(q_state)
            for j in range(n + 1):
                if j == n:
                    c.pipe_q.consumer_release(q_state)
                    q_state.advance()
                if j < n:
                    yield c.pipe_k.consumer_wait(kv)
                    yield c.pipe_s.producer_acquire(s_state)
                    _qk(c, tile, n, 0, j, j % 2 if parity else s_state.index, kv.index)
                    c.pipe_k.consumer_release(kv)
                    c.pipe_s.producer_commit(s_state)
                    s_state.advance()
                    kv.advance()
                if j > 0:
                    yield c.pipe_p.consumer_wait(p_state)
                    yield c.pipe_v.consumer_wait(vs)
                    yield c.pipe_o.producer_acquire(o_state)
                    _pv(c, tile, n, 0, j - 1, (j - 1) % 2 if parity else p_state.index, vs.index, prev)
                    c.pipe_v.consumer_release(vs)
                    c.pipe_p.consumer_release(p_state)
                    c.pipe_o.producer_commit(o_state)
                    o_state.advance()
                    vs.advance()
                    p_state.advance()
        else:
            for j in range(n + 1):  # FlashAttentionForwardSm100.mma_two_tiles
                if j == n:
                    for t in range(2):  # fixed stages: q_state advanced at the waits
                        c.pipe_q.consumer_release(State(2, False, index=t))
                if j < n:
                    yield c.pipe_k.consumer_wait(kv)
                if j > 0:
                    yield c.pipe_v.consumer_wait(vs)
                for t in range(2):
                    if j > 0:
                        yield c.pipe_p.consumer_wait(p_state)
                        yield c.pipe_o.producer_acquire(o_state)
                        _pv(c, tile, n, t, j - 1, t, vs.index, prev)
                        c.pipe_p.consumer_release(p_state)
                        if t == 1:
                            c.pipe_v.consumer_release(vs)
                            vs.advance()
                        c.pipe_o.producer_commit(o_state)
                        o_state.advance()
                        p_state.advance()
                    if j < n:
                        if j == 0:
                            yield c.pipe_q.consumer_wait(q_state)
                            q_state.advance()
                        yield c.pipe_s.producer_acquire(s_state)
                        _qk(c, tile, n, t, j, t, kv.index)
                        if t == 1:
                            c.pipe_k.consumer_release(kv)
                            kv.advance()
                        c.pipe_s.producer_commit(s_state)
                        s_state.advance()
        prev = (tile, n - 1)


def softmax(c: Cta, t: int, step: int | None = None):
    """FlashAttentionForwardSm100.softmax / _softmax_block with its _tile_state arithmetic (states
    from stage t, advanced by q_stage; `step` overrides that, for the mutant test)."""
    q = c.q_stage if step is None else step
    s_state = State(2, False, index=t if c.q_stage == 2 else 0)
    p_state = State(2, True, index=t if c.q_stage == 2 else 0)
    sc_state = State(2 * c.q_stage, True, index=t if c.q_stage == 2 else 0)
    for tile, n in c.busy():
        for j in range(n):
            buf = s_state.index  # alternating with one Q tile (across tiles too), t with two
            yield c.pipe_s.consumer_wait(s_state)
            assert c.s[buf] == ("S", tile, t, j), ("S", buf, c.s[buf], tile, t, j)
            c.s[buf] = None
            c.pipe_s.consumer_release(s_state)
            s_state.advance(q)
            yield c.pipe_p.producer_acquire(p_state)
            assert c.p[buf] is None, ("P over an unread P", buf, c.p[buf])
            c.p[buf] = ("P", tile, t, j)
            c.pipe_p.producer_commit(p_state)
            p_state.advance(q)
            if j > 0:
                yield c.pipe_scale.producer_acquire(sc_state)
                assert c.scale[sc_state.index] is None, ("scale slot overwritten", sc_state.index)
                c.scale[sc_state.index] = ("scale", tile, t, j)
                c.pipe_scale.producer_commit(sc_state)
                sc_state.advance(q)
        yield c.pipe_scale.producer_acquire(sc_state)
        assert c.scale[sc_state.index] is None, ("scale slot overwritten", sc_state.index)
        c.scale[sc_state.index] = ("inv", tile, t)
        c.pipe_scale.producer_commit(sc_state)
        sc_state.advance(q)


def correction(c: Cta):
    o_state, sc_state = State(c.q_stage, False), State(2 * c.q_stage, False)
    for tile, n in c.busy():
        for j in range(n):
            for t in range(c.q_stage):
                yield c.pipe_o.consumer_wait(o_state)
                assert c.o[t] == (tile, list(range(j + 1))), ("O", t, c.o[t], tile, j)
                yield c.pipe_scale.consumer_wait(sc_state)
                last = j == n - 1
                assert c.scale[sc_state.index] == (("inv", tile, t) if last else ("scale", tile, t, j + 1)), \
                    (c.scale, sc_state.index, tile, t, j)
                c.scale[sc_state.index] = None
                c.pipe_scale.consumer_release(sc_state)
                sc_state.advance()
                if last:
                    c.stored.append((tile, t))
                c.o_ready[t] = (tile, j)  # rescaled for block j + 1's P.V (or stored)
                c.pipe_o.consumer_release(o_state)
                o_state.advance()


def run(q_stage: int, stages: int, tiles: list[int], seed: int, softmax_step: int | None = None,
        gather: bool = False, mma_parity: bool = False):
    c = Cta(q_stage, stages, tiles, gather)
    roles = {"load": load(c), "mma": mma(c, mma_parity), "correction": correction(c)}
    roles.update({f"softmax{t}": softmax(c, t, softmax_step) for t in range(q_stage)})
    waiting = {name: None for name in roles}
    rng = random.Random(seed)
    while roles:
        ready = [n for n in roles if waiting[n] is None or waiting[n][0].completed % 2 != waiting[n][1]]
        assert ready, f"deadlock: every role waits ({ {n: w[1] for n, w in waiting.items()} })"
        name = rng.choice(ready)
        try:
            waiting[name] = next(roles[name])
        except StopIteration:
            del roles[name], waiting[name]
    return c


CASES = [("kvcache", 128, sm100_fwd_config(128, packed_rows=128)), ("dense", 128, sm100_fwd_config(128)),
         ("dense", 64, sm100_fwd_config(64)), ("dense", 256, sm100_fwd_config(256))]


# Tiles per CTA: one (causal / windowed grids, the KV cache), or a persistent CTA's several, with
# tiles of no keys (a varlen tile past its sequence) between them.
TILE_LISTS = [[0], [1], [2], [3], [7], [3, 1, 2], [2, 0, 3, 0, 1], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("family,hd,cfg", CASES, ids=[f"{f}-hd{hd}-q{c.q_stage}" for f, hd, c in CASES])
@pytest.mark.parametrize("tiles", TILE_LISTS, ids=["-".join(map(str, t)) for t in TILE_LISTS])
def test_every_interleaving_of_the_roles_finishes_with_the_right_data(family, hd, cfg, tiles):
    for seed in range(40):
        c = run(cfg.q_stage, cfg.ring_stages, tiles, seed)
        busy = [i for i, n in enumerate(tiles) if n]
        assert sorted(c.stored) == sorted((i, t) for i in busy for t in range(cfg.q_stage))
        if busy:
            last = busy[-1]
            assert c.o == [(last, list(range(tiles[last])))] * cfg.q_stage


GATHER_CASES = [(hd, sm100_fwd_config(hd, packed_rows=128)) for hd in (128, 256)]  # 3 and 2 stages per ring


@pytest.mark.parametrize("hd,cfg", GATHER_CASES, ids=[f"hd{hd}-stages{c.ring_stages}" for hd, c in GATHER_CASES])
@pytest.mark.parametrize("n_blocks", [0, 1, 2, 5])
def test_the_one_row_gather_hands_its_stages_over_a_block_late(hd, cfg, n_blocks):
    # The KV cache's one-row page pieces: a block's K and V stages are committed once the next
    # block's K copies are issued; with the smallest ring (two stages) that must not deadlock (it
    # did when the commit came after the next block's V stage was acquired) nor let a stage be
    # overwritten before the MMA warp has used it (the tags of a later block would show).
    for seed in range(40):
        c = run(1, cfg.ring_stages, [n_blocks], seed, gather=True)
        assert c.o == ([(0, list(range(n_blocks)))] if n_blocks else [None])


def test_the_model_catches_a_wrong_stage_step():
    """Were the softmax warpgroups to step their states by one (the one-tile arithmetic) with two Q
    tiles, they would use each other's stages: the model must fail (a deadlock or the other tile's
    data), not pass."""
    failures = 0
    for seed in range(20):
        try:
            run(2, 2, [3], seed, softmax_step=1)
        except AssertionError:
            failures += 1
    assert failures == 20


def test_the_model_catches_buffers_chosen_by_block_parity():
    """The one-tile MMA warp chose S and P buffers by the block's parity while the softmax took the
    pipeline stage. One tile per CTA agrees either way (both start at stage 0), which is why only a
    persistent CTA (head_dim 192/256 full attention) after a tile of odd length would have read the
    wrong S: the model must fail there and pass with one tile."""
    for seed in range(10):
        run(1, 3, [3], seed, mma_parity=True)
        with pytest.raises(AssertionError):
            run(1, 3, [3, 1, 2], seed, mma_parity=True)
