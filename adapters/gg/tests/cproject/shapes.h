#ifndef SHAPES_H
#define SHAPES_H
long square_area(long side);
long circle_area_x100(long radius);
#endif
