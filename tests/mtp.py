"""Tiny targets with a multi-token prediction layer, random weights, and the float64 reference of its drafts
(`models/mtp.py`)."""

import json

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from safetensors.torch import load_file

from tests.conftest import _tiny_hf_model
from tests.eagle import greedy_pick

MTP_FILE = "model-mtp.safetensors"  # beside model.safetensors, which transformers reads alone


def write_mtp_target(directory, kind: str, tokenizer, own_tables: tuple[str, ...] = (), seed: int = 0) -> None:
    """A tiny `kind` ("glm4-moe", "deepseek-v3") model of transformers with one layer more than its config.json
    says, that last layer its MTP layer's decoder layer (`num_nextn_predict_layers` 1), with the MTP layer's
    own pieces beside it (random norms and `eh_proj`; copies of the model's embeddings and LM head, as
    DeepSeek-V3's checkpoints hold them, but random ones of its own for those `own_tables` names: "embed_tokens",
    "head")."""
    model = _tiny_hf_model(kind, layers_added=1).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    layer = config["num_hidden_layers"] - 1
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layer,
                                                       "num_nextn_predict_layers": 1}))
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]

    def weight(*shape, mean=0.0):
        return (mean + rng.standard_normal(shape) * 0.3).astype(np.float32)

    prefix = f"model.layers.{layer}."
    tensors = {prefix + "enorm.weight": weight(hidden, mean=1.0), prefix + "hnorm.weight": weight(hidden, mean=1.0),
               prefix + "eh_proj.weight": weight(hidden, 2 * hidden),
               prefix + "shared_head.norm.weight": weight(hidden, mean=1.0)}
    for table, name, model_table in (("embed_tokens", "embed_tokens.weight", model.model.embed_tokens),
                                     ("head", "shared_head.head.weight", model.lm_head)):
        own = table in own_tables
        tensors[prefix + name] = weight(vocab, hidden) if own else model_table.weight.detach().numpy().copy()
    save_file(tensors, str(directory / MTP_FILE))


# The MTP layer's pieces as llama.cpp names them (`blk.{L}.nextn.*`)
_NEXTN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "shared_head_norm",
          "shared_head.head": "shared_head_head", "embed_tokens": "embed_tokens"}


def write_mtp_gguf(path, directory, tokenizer_gguf) -> None:
    """The GLM-4.5 MTP target of `directory` (`write_mtp_target`) as llama.cpp's converter writes a `glm4moe`
    file: the MTP layer's block after the model's, counted in the block count, its pieces as `nextn` tensors."""
    from tests.models.test_gguf_families import experts_as_llama_cpp_stores_them, write_gguf_tensors
    from tests.models.test_gguf_glm import _llama_cpp_name, _metadata

    config = transformers.AutoConfig.from_pretrained(directory)
    layer = config.num_hidden_layers
    whole = transformers.AutoConfig.from_pretrained(directory, num_hidden_layers=layer + 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, config=whole, dtype=torch.float32)
    tensors = [(_llama_cpp_name(name), array) for name, array in experts_as_llama_cpp_stores_them(model)]
    prefix = f"model.layers.{layer}."
    for name, tensor in load_file(str(directory / MTP_FILE)).items():
        piece = name.removeprefix(prefix).removesuffix(".weight")
        tensors.append((f"blk.{layer}.nextn.{_NEXTN[piece]}.weight", tensor.numpy()))
    write_gguf_tensors(path, "glm4moe", config, tensors, tokenizer_gguf, _metadata(config, mtp_layers=1))


class MtpReference:
    """The target and its MTP layer in float64 with transformers' PyTorch model of one layer more: the target's
    features are the normed output of its first L layers, and the MTP layer is transformers' layer L between
    the MTP pieces written out from their definition."""

    def __init__(self, directory) -> None:
        config = transformers.AutoConfig.from_pretrained(directory)
        self.layer = config.num_hidden_layers
        config.num_hidden_layers += 1
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, config=config, dtype=torch.float64, attn_implementation="eager",
            experts_implementation="eager").eval()
        self.eps = config.rms_norm_eps
        prefix = f"model.layers.{self.layer}."
        self.w = {name.removeprefix(prefix): tensor.to(torch.float64)
                  for name, tensor in load_file(str(directory / MTP_FILE)).items()}

    def _norm(self, x, name):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[f"{name}.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], float]:
        """The MTP layer's k greedy drafts after `tokens`, and the smallest gap between the two largest logits
        of its choices."""
        inner = self.model.model
        states = inner(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        features = inner.norm(states[self.layer][0])  # [n, D]: the target's final (normed) states
        block = inner.layers[self.layer]
        inputs, feeds = list(tokens[1:]), list(features[:-1])
        drafts, gap = [], np.inf
        for _ in range(k):
            m = len(inputs)
            embedded = self.w["embed_tokens.weight"][torch.tensor(inputs)].clone()
            embedded[0] = 0  # position 0's, as vLLM's
            fused = torch.cat([self._norm(embedded, "enorm"), self._norm(torch.stack(feeds), "hnorm")], dim=-1)
            x = (fused @ self.w["eh_proj.weight"].T)[None]
            positions = torch.arange(m)[None]
            mask = torch.triu(torch.full((m, m), -torch.inf, dtype=torch.float64), 1)[None, None]
            out = block(x, attention_mask=mask, position_ids=positions,
                        position_embeddings=inner.rotary_emb(x, positions))
            out = (out[0] if isinstance(out, tuple) else out)[0]  # [m, D]
            logits = (self._norm(out[-1], "shared_head.norm") @ self.w["shared_head.head.weight"].T).numpy()
            best, margin = greedy_pick(logits)
            gap = min(gap, margin)
            drafts.append(best)
            inputs.append(drafts[-1])
            feeds.append(out[-1])  # the layer's output stands in for the target's feature
        return drafts, gap
