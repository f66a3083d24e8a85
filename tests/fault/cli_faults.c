/*
 * Linked into kvwire-faults, the CLI the soak runs: the commands of kvwire plus the
 * fault-injecting wrapper, selected by name (`--transport fault:tcp`, faults from
 * KVW_FAULTS). The installed kvwire has neither this file nor the wrapper.
 */
#include "fault/fault.h"

__attribute__((constructor)) static void faults_cli_init(void)
{
    kvw__tl_fault_register();
}
