/* Checks shared by the tests: an operation or a room that must have failed, with the
 * expected status and a reason naming the cause. */
#include "testkit.h"

#include <stdio.h>

int kvt_expect_failure(const char *what, kvw_status_t got, kvw_status_t want,
                       const char *reason, const char *needle, char *msg, size_t cap)
{
    if (reason == NULL)
        reason = "";
    if (got == KVW_OK || got == KVW_INPROGRESS)
        snprintf(msg, cap, "%s: %s, expected a failure (%s)", what, kvw_status_string(got),
                 want != KVW_OK ? kvw_status_string(want) : "any status");
    else if (want != KVW_OK && got != want)
        snprintf(msg, cap, "%s: failed with %s, expected %s: %s", what, kvw_status_string(got),
                 kvw_status_string(want), reason);
    else if (reason[0] == '\0')
        snprintf(msg, cap, "%s: failed with %s but without a reason", what,
                 kvw_status_string(got));
    else if (needle != NULL && !kvt_contains(reason, needle))
        snprintf(msg, cap, "%s: the reason lacks '%s': %s", what, needle, reason);
    else
        return 0;
    return -1;
}
