"""DDTree speculative decoding: GPU-native draft trees for DFlash drafters."""

from ddtree.tree import DraftTree, build_tree
from ddtree.verify import Acceptance, walk

__all__ = ["Acceptance", "DraftTree", "build_tree", "walk"]
__version__ = "0.1.0"
