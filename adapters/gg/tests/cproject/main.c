#include <stdio.h>
#include <stdlib.h>
#include "shapes.h"

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 3;
    printf("%s %ld %ld\n", GREETING, square_area(n), circle_area_x100(n));
    return 0;
}
