/* The block types gguf_int8.c multiplies, one header each (see int8_q4_0.h for what a
   header holds): ggml's, and from 1000 updraft's own (int8_u4.h, int8_u8.h), which
   never meet a file's. X(type code, name, values per block, file bytes per block, bytes
   of eight rows' block in a group). */
#include "int8_q4_0.h"
#include "int8_q8_0.h"
#include "int8_q4_k.h"
#include "int8_q6_k.h"
#include "int8_q4_1.h"
#include "int8_q5_0.h"
#include "int8_q5_1.h"
#include "int8_iq4_nl.h"
#include "int8_mxfp4.h"
#include "int8_q2_k.h"
#include "int8_q3_k.h"
#include "int8_q5_k.h" /* after int8_q4_k.h: its scale packing */
#include "int8_iq4_xs.h"
#include "int8_u4.h"
#include "int8_u8.h"

#define INT8_TYPE_LIST(X)                                                                 \
    X(2, q4_0, 32, 18, 144)                                                               \
    X(8, q8_0, 32, 34, 272)                                                               \
    X(12, q4_k, 256, 144, 1184)                                                           \
    X(14, q6_k, 256, 210, 1680)                                                           \
    X(3, q4_1, 32, 20, 160)                                                               \
    X(6, q5_0, 32, 22, 176)                                                               \
    X(7, q5_1, 32, 24, 192)                                                               \
    X(20, iq4_nl, 32, 18, 144)                                                            \
    X(39, mxfp4, 32, 17, 136)                                                             \
    X(10, q2_k, 256, 84, 672)                                                             \
    X(11, q3_k, 256, 110, 912)                                                            \
    X(13, q5_k, 256, 176, 1440)                                                           \
    X(23, iq4_xs, 256, 136, 1104)                                                         \
    X(1000, u4_32, 32, 21, 168)                                                           \
    X(1001, u4_128, 128, 69, 552)                                                         \
    X(1002, u8_32, 32, 36, 288)                                                           \
    X(1003, u8_128, 128, 132, 1056)
