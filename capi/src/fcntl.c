/* exs_fcntl(int fd, int cmd, ...): the C-variadic entry point of exs.h. Stable Rust cannot define a variadic
 * function, so this reads the argument of the commands that take one and calls exs_fcntl_int (src/fcntl.rs) with
 * it. Reading va_arg for a command that takes none would be undefined behaviour.
 *
 * The commands that take an int: F_SETFL and every EXS_F_SET_*. The option commands come in pairs, a getter
 * then its setter, from EXS_F_GET_SEND_CREDITS to EXS_F_SET_COALESCE, so the setters are the odd offsets of that
 * range; fcntl.rs's test `the_variadic_entry_reads_an_argument_for_exactly_the_setters` pins it against the
 * option table. */
#include <fcntl.h>
#include <stdarg.h>

#include "exs.h"

static int takes_arg(int cmd)
{
    if (cmd == F_SETFL)
        return 1;
    return cmd >= EXS_F_GET_SEND_CREDITS && cmd <= EXS_F_SET_COALESCE &&
           (cmd - EXS_F_GET_SEND_CREDITS) % 2 == 1;
}

int exs_fcntl(int fd, int cmd, ...)
{
    int arg = 0;
    if (takes_arg(cmd)) {
        va_list ap;
        va_start(ap, cmd);
        arg = va_arg(ap, int);
        va_end(ap);
    }
    return exs_fcntl_int(fd, cmd, arg);
}
