"""GPT-2: pre-LayerNorm transformer, GELU MLP, tied input/output embeddings, flash attention via SDPA;
or attention that stays inside each document (model.attention: document) through FlexAttention's block
mask when compiled on a GPU, a masked SDPA otherwise (FlexAttention has no backward on CPU, and without
compilation it runs unfused)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokstream.errors import UserError
from tokstream.train.config import ModelConfig

# Dense bf16 tensor-core peak per GPU, by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_bf16_flops() -> float | None:
    """The current CUDA device's bf16 peak, if we know the device (for MFU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        """`mask`: None (causal), a boolean (batch, 1, length, length) mask, or a FlexAttention BlockMask."""
        batch, length, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask
            from torch.nn.attention.flex_attention import flex_attention  # imports dynamo: only when used

            y = flex_attention(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, length, channels))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


def document_mask(documents: torch.Tensor, flex: bool):
    """Causal attention within each document, from each token's document index (batch, length): a boolean mask,
    or with `flex` a FlexAttention BlockMask. GPT.__init__ keeps it out of a compiled graph."""
    batch, length = documents.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask  # imports dynamo: only when used

        def same_document_before(b, h, q, kv):
            return (documents[b, q] == documents[b, kv]) & (q >= kv)
        return create_block_mask(same_document_before, batch, None, length, length, device=documents.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


ATTENTION = ("causal", "document")
POSITIONS = ("absolute", "document")


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.attention not in ATTENTION or config.positions not in POSITIONS:
            raise UserError(f"model.attention must be one of {', '.join(ATTENTION)} and model.positions one of "
                            f"{', '.join(POSITIONS)}, got {config.attention!r} and {config.positions!r}")
        if config.positions == "document" and config.attention != "document":
            raise UserError("model.positions=document needs model.attention=document: a token would attend across "
                            "documents whose positions restart")
        if config.attention == "document" and config.dropout:
            raise UserError("model.dropout with model.attention=document: FlexAttention, which it uses on a GPU, has no "
                            "dropout; set model.dropout=0")
        self.config = config
        if config.attention == "document":
            # Built outside the compiled graph: tracing create_block_mask inside a compiled forward is fragile
            # across torch versions, and a BlockMask passed into compiled attention is FlexAttention's documented
            # use. Made here, not at import: torch.compiler.disable imports dynamo (seconds of every start-up).
            self.document_mask = torch.compiler.disable(document_mask)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total - self.wpe.weight.numel() if non_embedding else total

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, flex: bool | None = None) -> torch.Tensor:
        """Mean cross-entropy over all positions when targets are given, else logits. With attention: document,
        `documents` (each token's document index) and, with positions: document, `positions` (within its
        document): the reader's (tokstream.reader, max_documents). `flex`: FlexAttention's block mask (default:
        when compiled on a GPU) rather than a masked SDPA."""
        mask = None
        if self.config.attention == "document":
            if documents is None or (self.config.positions == "document" and positions is None):
                raise UserError("model.attention=document needs each token's documents= (and with positions=document "
                                "its positions=): TrainBatches(max_documents=...) gives them")
            flex = (idx.is_cuda and torch.compiler.is_compiling()) if flex is None else flex
            mask = self.document_mask(documents, flex)
        if self.config.positions == "absolute":
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B): 6N plus attention."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size

    def optimizer(self, lr: float, weight_decay: float, betas: tuple[float, float], device_type: str):
        """AdamW with weight decay on matrices only; fused kernels where the device has them."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device_type in ("cuda", "cpu"))
