/* The host build of include/bgs_gen_loop.h (external linkage, called from Rust). The step
 * policy's definitions come from step_policy.c. */
#define BGS_GEN_LOOP_IMPL
#include "bgs_gen_loop.h"
