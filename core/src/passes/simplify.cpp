// The pass pipeline: each pass can expose work for another (dropping size-1 reductions can
// put a sum right after the Linear; folding a BatchNorm can do the same), so run them in
// order until none applies. Every pass strictly shrinks the chain or marks prep, except the
// softmax rewrite, which replaces a node that cannot reappear, and the hoist of scalars over
// a sum, which leaves the sum first (where it no longer applies); so this terminates.
#include "gemmfuse/passes.h"

namespace gemmfuse {

Rewrites simplify(Chain& chain, WeightPrep& prep, bool for_training) {
  Rewrites all;
  for (int round = 0; round < 64; ++round) {
    const size_t before = all.size();
    auto add = [&](Rewrites r) { all.insert(all.end(), r.begin(), r.end()); };
    add(drop_identity_dropout(chain));
    add(drop_size1_reductions(chain));
    add(fold_scalar_chains(chain));
    if (!for_training) add(fold_eval_batchnorm(chain, prep));
    add(hoist_scalars_over_sum(chain));
    add(sum_to_gemv(chain, prep));
    if (all.size() == before) break;
  }
  return all;
}

}  // namespace gemmfuse
