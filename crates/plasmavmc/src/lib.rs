//! PlasmaVMC: image and volume control plane (to be built; see issue tracker).
