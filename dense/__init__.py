"""Dense evaluation from the cache (issue 57): semantic segmentation, depth and Hummingbird
dense k-NN from stored patch-token grids and the targets stored beside them."""
