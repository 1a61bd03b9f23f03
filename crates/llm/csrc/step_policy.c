/* The host build of include/bgs_step_policy.h (external linkage, called from Rust). */
#define BGS_STEP_POLICY_IMPL
#include "bgs_step_policy.h"
