"""JetSpec: lossless tree speculative decoding with a causal parallel draft head (arXiv 2606.18394)."""

from transformers import AutoConfig, AutoModel

from .answer_cache import AnswerCache
from .candidate_generator import JetSpecCandidateGenerator, chain_generate
from .configuration_jetspec import JetSpecConfig, default_target_layer_ids
from .state import JetSpecGenerateOutput, JetSpecStats, TreeShape, resolve_tree_shape
from .modeling_jetspec import JetSpecContext, JetSpecDraftModel, JetSpecOutput, stack_target_states
from .integration import install_generate_hook, uninstall_generate_hook
from .round_hook import RoundRecord
from .tree import Tree, ancestor_mask, ancestor_mask_of, build_tree, marginal_children

AutoConfig.register("jetspec", JetSpecConfig, exist_ok=True)
AutoModel.register(JetSpecConfig, JetSpecDraftModel, exist_ok=True)

__all__ = [
    "AnswerCache",
    "JetSpecCandidateGenerator",
    "JetSpecConfig",
    "JetSpecContext",
    "JetSpecDraftModel",
    "JetSpecGenerateOutput",
    "JetSpecOutput",
    "JetSpecStats",
    "RoundRecord",
    "Tree",
    "TreeShape",
    "ancestor_mask",
    "ancestor_mask_of",
    "build_tree",
    "chain_generate",
    "default_target_layer_ids",
    "install_generate_hook",
    "marginal_children",
    "resolve_tree_shape",
    "stack_target_states",
    "uninstall_generate_hook",
]
