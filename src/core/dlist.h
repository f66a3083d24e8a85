/* Intrusive doubly linked lists: any struct with `prev` and `next` pointers to its own
 * type, headed by a pointer to the first element (NULL: empty). */
#ifndef KVW_CORE_DLIST_H
#define KVW_CORE_DLIST_H

/* Puts n first in the list. */
#define KVW_DLIST_PUSH(head, n)                                                          \
    do {                                                                                 \
        (n)->prev = NULL;                                                                \
        (n)->next = (head);                                                              \
        if ((n)->next)                                                                   \
            (n)->next->prev = (n);                                                       \
        (head) = (n);                                                                    \
    } while (0)

/* Takes n out of the list (its own prev and next are left as they were). */
#define KVW_DLIST_REMOVE(head, n)                                                        \
    do {                                                                                 \
        if ((n)->prev)                                                                   \
            (n)->prev->next = (n)->next;                                                 \
        else                                                                             \
            (head) = (n)->next;                                                          \
        if ((n)->next)                                                                   \
            (n)->next->prev = (n)->prev;                                                 \
    } while (0)

#endif
