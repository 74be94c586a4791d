/* slipstream's client hot paths: a thread's name (Aeron's aeron_thread_set_name), as ps -T,
 * top -H and perf show it.  See native.h for the contract. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>
#include <sys/prctl.h>

void ss_name_thread(const char *name) {
    static const char prefix[] = "slipstream-";
    char short_name[16] = "ss-";
    size_t used = 0;
    if (strncmp(name, prefix, sizeof prefix - 1) == 0) {
        name += sizeof prefix - 1;
        used = 3;
    }
    strncpy(short_name + used, name, sizeof short_name - 1 - used);
    short_name[sizeof short_name - 1] = 0;
    prctl(PR_SET_NAME, short_name, 0, 0, 0);
}
