/* lmtail: the CPU-feature probe as a library (kernels/cpu.py reads it): the LMTAIL_CPU_* bits
 * of lmtail_kernels.h, the same probe every kernel dispatches on. */
#include "lmtail_kernels.h"

unsigned lmtail_cpu_bits_export(void) { return lmtail_cpu_features(); }
