/* exs_fcntl(int fd, int cmd, ...): the C-variadic entry point of exs.h. Stable Rust cannot define a variadic
 * function, so this reads the argument of the commands that take one (the Rust side says which) and calls the
 * Rust function with it. Reading va_arg for a command that takes none would be undefined behaviour. */
#include <stdarg.h>

#include "exs.h"

int exs_internal_fcntl_takes_arg(int cmd);
int exs_internal_fcntl(int fd, int cmd, int arg);

int exs_fcntl(int fd, int cmd, ...)
{
    int arg = 0;
    if (exs_internal_fcntl_takes_arg(cmd)) {
        va_list ap;
        va_start(ap, cmd);
        arg = va_arg(ap, int);
        va_end(ap);
    }
    return exs_internal_fcntl(fd, cmd, arg);
}
