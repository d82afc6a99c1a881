"""ForwardBatch (the only thing that crosses runner -> model) and KimiCache (per-layer state and latent pools)."""
from dataclasses import dataclass

import torch


def cache_slots(blocks, start: int, n: int, block_size: int) -> list:
    """MLA cache slots (page * block_size + offset) of positions [start, start + n) of a sequence with pages
    `blocks` (the batch's slot_mapping)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor           # [T] i64; the num_decodes decode tokens first, then packed prefill chunks
    num_decodes: int
    cu_seqlens: torch.Tensor          # [N+1] i32, query lengths of all N sequences
    prefill_cu_seqlens: torch.Tensor  # [P+1] i32, relative to token num_decodes
    seq_lens: torch.Tensor            # [N] i32, keys per sequence after this step
    state_slots: torch.Tensor         # [N] i32, KDA conv/recurrent slot (0 = null)
    has_initial_state: torch.Tensor   # [N] bool, false on a sequence's first chunk
    block_table: torch.Tensor         # [N, MB] i32, MLA pages (0 = null)
    slot_mapping: torch.Tensor        # [T] i64, page * BS + offset, -1 = skip
    logits_index: torch.Tensor        # [M] i64, tokens whose logits are computed
    max_query_len: int
    prefill_keys: int = -1            # keys of the prefill sequences after this step (sum of their seq_lens; host
                                      # int: sizes the expanded MLA's gather without a sync), -1 = unknown
    meta: object = None               # set by the model per forward: metadata shared by its layers (StepMeta)

    @property
    def num_prefills(self) -> int:
        return self.prefill_cu_seqlens.numel() - 1

    @classmethod
    def build(cls, seqs, num_decodes: int, block_size: int, device, logits_positions=None) -> "ForwardBatch":
        """seqs: [(token_ids, num_cached_tokens, state_slot, block_ids), ...], decodes (one token each) first.

        logits_positions: token indices in the packed batch; None = the last token of every sequence.
        """
        assert 0 <= num_decodes <= len(seqs)
        assert all(len(s[0]) == 1 for s in seqs[:num_decodes]), "decode sequences carry one token"
        assert all(len(s[0]) >= 1 for s in seqs), "every sequence carries a token"
        lens = [len(ids) for ids, _, _, _ in seqs]
        seq_lens = [cached + n for (_, cached, _, _), n in zip(seqs, lens)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        slots = []
        for ids, cached, _, blocks in seqs:
            assert cached + len(ids) <= len(blocks) * block_size, "not enough pages for the sequence"
            slots += cache_slots(blocks, cached, len(ids), block_size)
        max_blocks = max(len(s[3]) for s in seqs)
        table = [list(s[3]) + [0] * (max_blocks - len(s[3])) for s in seqs]
        if logits_positions is None:
            logits_positions = [c - 1 for c in cu[1:]]

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        def i64(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            input_ids=i64([t for ids, _, _, _ in seqs for t in ids]), num_decodes=num_decodes,
            cu_seqlens=i32(cu), prefill_cu_seqlens=i32([c - cu[num_decodes] for c in cu[num_decodes:]]),
            seq_lens=i32(seq_lens),
            state_slots=i32([s[2] for s in seqs]),
            has_initial_state=torch.tensor([s[1] > 0 for s in seqs], dtype=torch.bool, device=device),
            block_table=i32(table), slot_mapping=i64(slots), logits_index=i64(logits_positions),
            max_query_len=max(lens), prefill_keys=sum(seq_lens[num_decodes:]),
        )


@dataclass(slots=True)
class KimiCache:
    conv_state: list[torch.Tensor]  # per KDA layer [S, W-1, 3*H*K], model dtype; slot 0 null
    rec_state: list[torch.Tensor]   # per KDA layer [S, H, K, V] fp32; slot 0 null
    latent: list[torch.Tensor]      # per MLA layer [NB, BS, L+R]; page 0 null
    block_size: int
