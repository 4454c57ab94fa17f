// Simplification passes over the Chain IR. Each pass rewrites the chain in place and returns
// one human-readable line per rewrite it applied (they go into Plan::rewrites and `explain`).
// Every pass keeps the chain's meaning exactly as PyTorch would compute it in fp32, NaN and
// inf included; a value that a later `v<i>` operand reads is never folded away.
#pragma once

#include <string>
#include <vector>

#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"

namespace gemmfuse {

using Rewrites = std::vector<std::string>;

// ---- editing helpers (core/src/passes/chain_edit.cpp) -----------------------------------

// Whether any operand of any node reads value v<value_id> (b, weight, bias, ...).
bool value_referenced(const Chain& chain, int value_id);

// Remove nodes[index] (the producer of v<index+1>). Later readers of v<index+1> read its
// input v<index> instead (right for an identity, or for a node whose value nobody reads);
// v<j> for j > index+1 becomes v<j-1>.
void remove_node(Chain& chain, int index);

// Insert `node` at nodes[index], reading v<index> and producing v<index+1>. It continues the
// node before it: later readers of v<j> for j >= index now read v<j+1> (so a reader of the
// old v<index> sees the new node's output). `node`'s own operands are taken as given.
void insert_node(Chain& chain, int index, const Node& node);

// ---- the passes (core/src/passes/<name>.cpp) ----------------------------------------------

// Dropout in eval mode or with p = 0 is the identity: removed.
Rewrites drop_identity_dropout(Chain& chain);

// A reduction (sum/mean/max/min/logsumexp) over a size-1 last dim is the identity: removed
// when keepdim=1; with keepdim=0 the dim must still go, so it is merged into the reduction
// that made the width 1 (that one gets keepdim=0) or, failing that, kept.
// softmax over size 1 -> `mul b=0`, `add b=1`; log_softmax over size 1 -> `sub b=v<self>`
// (so NaN/inf behave as in PyTorch: both give NaN for a non-finite input).
Rewrites drop_size1_reductions(Chain& chain);

// `add b=v<input>` (x + x) -> `mul b=2`; consecutive `mul` by immediates that are powers of
// two >= 1 -> one `mul` (exact in fp32 while the product stays a finite float).
Rewrites fold_scalar_chains(Chain& chain);

// `batch_norm training=0` with running stats as the first stage (and v0 read by nobody):
// removed from the chain and recorded in prep (fold_batchnorm, batchnorm) so that executors
// prepare W' = W*s[n], b' = (b - running_mean)*s + beta, s = gamma / sqrt(running_var + eps).
Rewrites fold_eval_batchnorm(Chain& chain, WeightPrep& prep);

// Scalar affine stages (neg; mul, add, sub by a finite immediate; div by a finite nonzero
// one) from the Linear up to a `sum`/`mean`, none of their values read elsewhere: the
// reduction moves first and the stages follow it, an added constant times the row width N
// for a sum (sum(a*v + c) = a*sum(v) + N*c), so that sum_to_gemv applies.
Rewrites hoist_scalars_over_sum(Chain& chain);

// `sum`/`mean` (any keepdim) as the first stage, with v0 read by nobody: the Linear and the
// reduction become one GEMV over the column sums of W (prep.column_sums = true). The node
// stays in the chain as nodes[0] (so widths keep their meaning); the planner turns the
// Linear plus nodes[0] into a Gemv step.
Rewrites sum_to_gemv(Chain& chain, WeightPrep& prep);

// All of the above, in the order dropout, size-1 reductions, scalar chains, eval BatchNorm,
// scalars over a sum, GEMV, repeated until none applies. For a plan that autograd will differentiate
// (`for_training`) the eval BatchNorm stays a stage: its fold would hide the pre-norm values
// that the gradients of gamma and beta need.
Rewrites simplify(Chain& chain, WeightPrep& prep, bool for_training = false);

}  // namespace gemmfuse
