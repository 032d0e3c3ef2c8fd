"""Speculation math over torch tensors: trees, sampling, verification, drafting policies.

Pure functions and small value types; no models, no I/O, no globals.

Note: ``workers.speculation.verify`` the attribute is the function re-exported here,
not the submodule; reach the module with ``importlib.import_module``
("workers.speculation.verify") or import names from it directly.
"""

from workers.speculation.ngram import ngram_tree
from workers.speculation.policy import (
    DEFAULT_TREE,
    DRAFT_TOP_K,
    DynamicTreePolicy,
    StaticTreePolicy,
    TreeBuilder,
    TreePolicy,
    choose_children,
)
from workers.speculation.sampling import SamplingParams, make_generator, sample, target_probs
from workers.speculation.tree import (
    TokenTree,
    TreeError,
    children,
    depths,
    leaf_paths,
    merge_trees,
    path_to,
    tree_mask,
    validate_tree,
)
from workers.speculation.verify import Verdict, greedy_verify, stochastic_verify, verify

__all__ = [
    "DEFAULT_TREE",
    "DRAFT_TOP_K",
    "DynamicTreePolicy",
    "SamplingParams",
    "StaticTreePolicy",
    "TokenTree",
    "TreeBuilder",
    "TreeError",
    "TreePolicy",
    "Verdict",
    "children",
    "choose_children",
    "depths",
    "greedy_verify",
    "leaf_paths",
    "make_generator",
    "merge_trees",
    "ngram_tree",
    "path_to",
    "sample",
    "stochastic_verify",
    "target_probs",
    "tree_mask",
    "validate_tree",
    "verify",
]
