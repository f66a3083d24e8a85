"""A real model decodes bit-identically from KV that went through kvwire.sglang.

transformers' GPT-OSS architecture, shrunk (4 layers: sliding-window and full attention
alternating, 4 KV heads, MoE, attention sinks) with random weights from a fixed seed,
bf16 on GPU 0. Two processes, as a disaggregated deployment runs them:

* prefill (TP1): runs the prompt through the model, writes the resulting K and V into
  SGLang-shaped CUDA KV pools (a full pool for the full-attention layers and a separate
  SWA pool for the sliding-window layers, each ``[slots + page_size, heads, head_dim]``
  per layer and role, slot 0's page reserved as SGLang reserves it), puts the first
  output token into an SGLang-style aux buffer (host memory), and sends the request
  through kvwire.sglang exactly as SGLang's scheduler calls it: ``KVManager(kv_args,
  mode, server_args, is_mla)``, ``KVSender(...)``, ``init(num_pages, aux_index)``,
  chunked ``send(page_indices)`` and a last ``send(page_indices, state_indices)``
  whose SWA entry is the SWA-pool pages of ``[floor_page(L - W), L)`` with SGLang's
  window ``W = sliding_window - 1``. It then decodes N tokens greedily from its own
  cache: the colocated reference.
* decode (TP2: two ranks, each its own KVManager, KV heads split 2 + 2): builds its
  pools filled with a sentinel, posts its own page lists with ``KVReceiver.init`` and
  ``send_metadata``, waits for Success, then checks every slot of every pool byte for
  byte (the request's token slots against the prefill's K/V, every other slot
  untouched) and rebuilds the model's cache from its pools only: a cache skeleton
  from its own forward pass is first filled with NaN, then every layer's keys and values
  are read out of the two ranks' pools. It decodes N tokens from the received first
  token and compares tokens and every logit bit for bit with the prefill's reference;
  then it changes one element of one layer's received K and shows that the logits
  change (the comparison has teeth).

Run on a GPU machine:  KVWIRE_LIB=build/libkvwire.so PYTHONPATH=python \
    python3 python/tests/gpu_sglang_model.py [--transport cuda_ipc|tcp]
Exits 0 when everything matched, 1 on any mismatch, 77 (with "skipped: ...") without
torch, transformers or a GPU.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
import types
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PAGE = 16           # tokens per page, both sides
SLOTS = 64 * PAGE   # pool size in tokens (plus one reserved page)
PROMPT = 45         # tokens: 3 pages, the last one partial
STEPS = 8           # tokens decoded after the first
HF_WINDOW = 16      # the HF config's sliding_window; SGLang's window is one less
SEED = 1234
SENTINEL = 0x5A
ROOM = 7001


def pack(obj):
    """Tensors cross the process boundary by value (torch.save), not as shared-memory
    handles, which die with the process that made them."""
    import io
    import torch
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def unpack(data):
    import io
    import torch
    return torch.load(io.BytesIO(data))


def skip(msg):
    print("gpu_sglang_model: skipped: %s" % msg)
    sys.exit(77)


def build_model(torch):
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=512, hidden_size=128, intermediate_size=128,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=HF_WINDOW, max_position_embeddings=4096,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(cfg).to(device="cuda:0", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # the same weights in both processes
            g = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p) * 0.08)
    return cfg, model


def weights_digest(torch, model):
    return float(sum(p.float().abs().sum().item() for p in model.parameters()))


def prompt_ids(torch):
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, 512, (1, PROMPT), generator=g).to("cuda:0")


def server_args(tp, port, hf_cfg):
    """The ServerArgs fields an SGLang scheduler has (plain DP off, no DP attention);
    get_model_config() returns what SGLang's ModelConfig wraps (hf_config,
    hf_text_config)."""
    mc = types.SimpleNamespace(hf_config=hf_cfg, hf_text_config=hf_cfg,
                               num_hidden_layers=hf_cfg.num_hidden_layers)
    return types.SimpleNamespace(
        tp_size=tp, dp_size=1, pp_size=1, enable_dp_attention=False, attn_cp_size=1,
        host="127.0.0.1", port=30000 + tp, disaggregation_bootstrap_port=port,
        dist_init_addr=None, disaggregation_ib_device=None, nnodes=1, node_rank=0,
        get_model_config=lambda: mc)


class Pools:
    """One rank's SGLang-shaped KV pools: per layer kind, K buffers then V buffers of
    shape [SLOTS + PAGE, heads, head_dim], bf16, CUDA."""

    def __init__(self, torch, kinds, heads, head_dim, fill=None):
        self.kinds, self.heads, self.hd = kinds, heads, head_dim
        mk = (lambda: torch.full((SLOTS + PAGE, heads, head_dim), 0, dtype=torch.bfloat16,
                                 device="cuda:0"))
        self.full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        self.swa = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        self.k = {i: mk() for i in range(len(kinds))}
        self.v = {i: mk() for i in range(len(kinds))}
        if fill is not None:
            for t in list(self.k.values()) + list(self.v.values()):
                t.view(torch.uint8).fill_(fill)

    def buf_infos(self, ids):
        ts = [self.k[i] for i in ids] + [self.v[i] for i in ids]
        return ([t.data_ptr() for t in ts], [t.nbytes for t in ts],
                [t[0].nbytes * PAGE for t in ts])

    def kv_args(self, kvmod, engine_rank, total_heads, aux):
        a = kvmod.KVArgs()
        a.engine_rank = engine_rank
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = self.buf_infos(self.full)
        a.state_types = [kvmod.StateType.SWA]
        p, l, i = self.buf_infos(self.swa)
        a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [p], [l], [i]
        a.aux_data_ptrs = [aux.data_ptr()]
        a.aux_data_lens = [aux.nbytes]
        a.aux_item_lens = [aux[0].nbytes]
        a.kv_head_num = self.heads
        a.total_kv_head_num = total_heads
        a.page_size = PAGE
        a.pp_rank = 0
        a.system_dp_rank = None
        a.prefill_start_layer = 0
        a.prefill_end_layer = len(self.kinds)
        a.gpu_id = 0
        a.ib_device = None
        return a


def slots_of(pages, first_token, last_token):
    """Pool slots of tokens [first_token, last_token) in a page list that starts at the
    page of first_token (first_token a page boundary)."""
    return [pages[(t - first_token) // PAGE] * PAGE + (t - first_token) % PAGE
            for t in range(first_token, last_token)]


def swa_first(num_tokens):
    w = HF_WINDOW - 1          # what SGLang's scheduler uses for gpt-oss
    return max(0, num_tokens - w) // PAGE * PAGE


def pick_pages(seed, n):
    import random
    r = random.Random(seed)
    return r.sample(range(1, SLOTS // PAGE + 1), n)


def wait_poll(obj, want, kvmod, what, timeout=60):
    KVPoll = kvmod.KVPoll
    end = time.time() + timeout
    while time.time() < end:
        st = obj.poll()
        if st == KVPoll.Failed:
            raise RuntimeError("%s failed: %s" % (what, obj.failure_exception()))
        if st in want:
            return st
        time.sleep(0.001)
    raise RuntimeError("%s: timed out in %s" % (what, obj.poll()))


def greedy(torch, model, cache, token, steps):
    toks, logits = [], []
    with torch.no_grad():
        for s in range(steps):
            out = model(input_ids=torch.tensor([[token]], device="cuda:0"),
                        past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[PROMPT + s]], device="cuda:0"))
            cache = out.past_key_values
            lg = out.logits[0, -1]
            token = int(lg.argmax())
            toks.append(token)
            logits.append(lg.float().cpu())
    return toks, torch.stack(logits)


def cache_tensors(cache):
    """[(keys, values)] per layer of a transformers cache."""
    if hasattr(cache, "layers"):
        return [(l.keys, l.values) for l in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def prefill_main(q_out, q_in, transport):
    os.environ["KVWIRE_TRANSPORT"] = transport
    import numpy as np
    import torch
    import kvwire.sglang as ks
    cfg, model = build_model(torch)
    ids = prompt_ids(torch)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    first = int(out.logits[0, -1].argmax())
    kinds = list(cfg.layer_types)
    layers = cache_tensors(cache)
    pools = Pools(torch, kinds, 4, 32)
    g = torch.Generator(device="cuda:0").manual_seed(SEED + 2)
    for t in list(pools.k.values()) + list(pools.v.values()):   # what the pools held
        t.copy_(torch.randn(t.shape, generator=g, device="cuda:0").to(t.dtype))
    full_pages = pick_pages(11, -(-PROMPT // PAGE))
    s0 = swa_first(PROMPT)
    swa_pages = pick_pages(12, -(-(PROMPT - s0) // PAGE))
    sent = {}
    for i, (k, v) in enumerate(layers):
        n = k.shape[2]                      # tokens this layer's cache holds: the last n
        lo = PROMPT - n
        if kinds[i] == "full_attention":
            assert n == PROMPT, (i, n)
            slots = slots_of(full_pages, 0, PROMPT)
        else:
            assert lo >= s0, ("HF keeps more SWA tokens than SGLang moves", i, n, s0)
            slots = slots_of(swa_pages, s0, PROMPT)[lo - s0:]
        idx = torch.tensor(slots, device="cuda:0")
        pools.k[i][idx] = k[0].transpose(0, 1)
        pools.v[i][idx] = v[0].transpose(0, 1)
        sent[i] = (lo, k[0].cpu(), v[0].cpu())
    aux = torch.zeros((16, 8), dtype=torch.int32)       # host memory, as SGLang's aux
    aux_index = 3
    aux[aux_index, 0] = first
    srv = ks.KVBootstrapServer("127.0.0.1", 0)
    # The pools as the prefill had them, for the decode's byte check (cpu copies).
    q_out.put(("ready", srv.port, weights_digest(torch, model), full_pages, swa_pages,
               pack({i: (pools.k[i].cpu(), pools.v[i].cpu()) for i in pools.k}), pack(sent)))
    mgr = ks.KVManager(pools.kv_args(ks, 0, 4, aux), "prefill", server_args(1, srv.port, cfg),
                       False)
    torch.cuda.synchronize()
    snd = ks.KVSender(mgr=mgr, bootstrap_addr="127.0.0.1:%d" % srv.port, bootstrap_room=ROOM,
                      dest_tp_ranks=[0, 1], pp_rank=0)
    wait_poll(snd, (ks.KVPoll.WaitingForInput,), ks, "prefill bootstrap")
    snd.init(len(full_pages), aux_index)
    # Two chunks, as chunked prefill sends them: whole pages first, the rest last.
    snd.send(np.array(full_pages[:2], dtype=np.int64), None)
    snd.send(np.array(full_pages[2:], dtype=np.int64), [np.array(swa_pages, dtype=np.int64)])
    wait_poll(snd, (ks.KVPoll.Success,), ks, "prefill transfer")
    toks, logits = greedy(torch, model, cache, first, STEPS)
    q_out.put(("done", first, toks, pack(logits)))
    q_in.get(timeout=120)     # keep the bootstrap server up until the decode has finished
    srv.close()


def decode_main(info, transport, q_back):
    os.environ["KVWIRE_TRANSPORT"] = transport
    import numpy as np
    import torch
    import kvwire.sglang as ks
    _, port, digest, _, _, prefill_pools, sent = info
    prefill_pools, sent = unpack(prefill_pools), unpack(sent)
    cfg, model = build_model(torch)
    assert weights_digest(torch, model) == digest, "the two processes built different weights"
    kinds = list(cfg.layer_types)
    ranks = []
    for r in range(2):
        pools = Pools(torch, kinds, 2, 32, fill=SENTINEL)
        aux = torch.full((16, 8), -1, dtype=torch.int32)
        mgr = ks.KVManager(pools.kv_args(ks, r, 4, aux), "decode", server_args(2, port, cfg), False)
        ranks.append((pools, aux, mgr))
    torch.cuda.synchronize()
    full_pages = pick_pages(21, -(-PROMPT // PAGE))
    s0 = swa_first(PROMPT)
    swa_pages = pick_pages(22, -(-(PROMPT - s0) // PAGE))
    aux_index = 9
    rvs = []
    for pools, aux, mgr in ranks:
        rv = ks.KVReceiver(mgr=mgr, bootstrap_addr="127.0.0.1:%d" % port, bootstrap_room=ROOM)
        rv.init(0)
        rv.send_metadata(np.array(full_pages, dtype=np.int64), aux_index,
                         [np.array(swa_pages, dtype=np.int64)])
        rvs.append(rv)
    for r, rv in enumerate(rvs):
        wait_poll(rv, (ks.KVPoll.Success,), ks, "decode rank %d" % r)
    torch.cuda.synchronize()
    problems = []
    # Every slot of every pool: the request's token slots hold the prefill's K/V for the
    # rank's heads, every other slot still holds the sentinel. The tail of the last page
    # (tokens past the prompt) may hold the sentinel or the prefill's bytes of those
    # slots (a backend may move whole pages); nothing else is allowed.
    bytes_checked = 0
    for r, (pools, aux, _) in enumerate(ranks):
        h0 = 2 * r
        for i in range(len(kinds)):
            swa = kinds[i] == "sliding_attention"
            first_tok = s0 if swa else 0
            mine = swa_pages if swa else full_pages
            src_pages = info[4] if swa else info[3]
            lo, ks_, vs_ = sent[i]
            for role, dst, src_pool, ref in ((0, pools.k[i], prefill_pools[i][0], ks_),
                                             (1, pools.v[i], prefill_pools[i][1], vs_)):
                d = dst.cpu()
                expect = torch.empty_like(d)
                expect.view(torch.uint8).fill_(SENTINEL)
                slot_d = slots_of(mine, first_tok, PROMPT)
                slot_s = slots_of(src_pages, first_tok, PROMPT)
                expect[slot_d] = src_pool[slot_s][:, h0:h0 + 2]
                # the tokens the model's cache holds must be exactly the model's K/V
                model_part = ref.transpose(0, 1)[:, h0:h0 + 2]
                held = slot_d[lo - first_tok:]
                if not torch.equal(expect[held].view(torch.uint8),
                                   model_part.contiguous().view(torch.uint8)):
                    problems.append("layer %d role %d: test bookkeeping" % (i, role))
                tail_d = [p * PAGE + o for p in mine[-1:] for o in range(PAGE)
                          if slot_d and p * PAGE + o not in set(slot_d)]
                tail_s = [p * PAGE + o for p in src_pages[-1:] for o in range(PAGE)
                          if p * PAGE + o not in set(slot_s)]
                alt = expect.clone()
                alt[tail_d] = src_pool[tail_s][:, h0:h0 + 2]
                ok = torch.equal(d.view(torch.uint8), expect.view(torch.uint8)) or \
                    torch.equal(d.view(torch.uint8), alt.view(torch.uint8))
                if not ok:
                    bad = (d.view(torch.uint8) != expect.view(torch.uint8)).any(-1).any(-1)
                    problems.append("rank %d layer %d %s: %d slots differ, first %s" % (
                        r, i, "KV"[role], int(bad.sum()), bad.nonzero()[:4].flatten().tolist()))
                bytes_checked += d.nbytes
        if int(aux[aux_index, 0]) < 0 or any(int(x) != -1 for j, row in enumerate(aux)
                                            if j != aux_index for x in row):
            problems.append("rank %d aux: %s" % (r, aux[aux_index].tolist()))
    # Rebuild the model's cache from the pools only.
    ids = prompt_ids(torch)
    with torch.no_grad():
        skel = model(input_ids=ids, use_cache=True).past_key_values
    for i, (k, v) in enumerate(cache_tensors(skel)):
        k.fill_(float("nan"))
        v.fill_(float("nan"))
        swa = kinds[i] == "sliding_attention"
        first_tok = s0 if swa else 0
        mine = swa_pages if swa else full_pages
        n = k.shape[2]
        slots = torch.tensor(slots_of(mine, first_tok, PROMPT)[PROMPT - n - first_tok:],
                             device="cuda:0")
        for r, (pools, _, _) in enumerate(ranks):
            k[0, 2 * r:2 * r + 2] = pools.k[i][slots].transpose(0, 1)
            v[0, 2 * r:2 * r + 2] = pools.v[i][slots].transpose(0, 1)
    first = int(ranks[0][1][aux_index, 0])
    import copy
    skel2 = copy.deepcopy(skel)
    toks, logits = greedy(torch, model, skel, first, STEPS)
    # The teeth: one element of layer 1's K (full attention) changed.
    cache_tensors(skel2)[1][0][0, 0, 5, 0] += 1.0
    _, logits_bad = greedy(torch, model, skel2, first, STEPS)
    for _, _, mgr in ranks:
        if hasattr(mgr, "close"):
            mgr.close()
    q_back.put((problems, bytes_checked, first, toks, pack(logits), pack(logits_bad)))


def run(transport):
    import torch
    ctx = mp.get_context("spawn")
    q_out, q_in, q_back = ctx.Queue(), ctx.Queue(), ctx.Queue()
    pre = ctx.Process(target=prefill_main, args=(q_out, q_in, transport))
    pre.start()
    info = q_out.get(timeout=300)
    dec = ctx.Process(target=decode_main, args=(info, transport, q_back))
    t0 = time.time()
    dec.start()
    try:
        problems, nbytes, first_d, toks_d, logits_d, logits_bad = q_back.get(timeout=300)
        _, first_p, toks_p, logits_p = q_out.get(timeout=60)
        logits_d, logits_bad, logits_p = unpack(logits_d), unpack(logits_bad), unpack(logits_p)
    finally:
        q_in.put("bye")
        dec.join(60)
        pre.join(60)
    wall = time.time() - t0
    if first_d != first_p:
        problems.append("first token: decode read %d from aux, prefill produced %d"
                        % (first_d, first_p))
    same_toks = toks_d == toks_p
    same_logits = torch.equal(logits_d.view(torch.int32), logits_p.view(torch.int32))
    teeth = not torch.equal(logits_bad, logits_p)
    if not same_toks:
        problems.append("tokens differ: decode %s, prefill %s" % (toks_d, toks_p))
    if not same_logits:
        problems.append("logits differ (max abs %g)" % float((logits_d - logits_p).abs().max()))
    if not teeth:
        problems.append("a changed K element left the logits unchanged: the check has no teeth")
    for p in problems:
        print("gpu_sglang_model %s: FAIL: %s" % (transport, p))
    print("gpu_sglang_model %-8s %s  TP1->TP2 gpt-oss (4 layers, SWA pool, page %d), %d-token "
          "prompt, pool bytes checked %d, tokens %s, logits bit-identical %s, one changed K "
          "element changes logits %s, %.1f s" % (transport, "PASS" if not problems else "FAIL",
                                                PAGE, PROMPT, nbytes, toks_d, same_logits,
                                                teeth, wall))
    return not problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", action="append", choices=["cuda_ipc", "tcp"])
    args = ap.parse_args()
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        skip("%s" % e)
    if not torch.cuda.is_available():
        skip("torch sees no CUDA device")
    ok = True
    for t in args.transport or ["cuda_ipc", "tcp"]:
        try:
            ok = run(t) and ok
        except Exception:
            traceback.print_exc()
            print("gpu_sglang_model %s: FAIL (exception above)" % t)
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
